"""Settings both sides parse the same way: the shared trainer's config and flags, the schema of a setting, the
bundled tasks' flags."""
