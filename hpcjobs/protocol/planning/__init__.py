"""Planning before anything is queued: the bundled model's sizes and each GPU's memory plan."""
