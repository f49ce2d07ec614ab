"""The job store: the local record of every job this machine submitted (sqlite), read by the followers."""
