"""Complete small scripts showing hpcjobs' node-side helpers in a user's own training code."""
