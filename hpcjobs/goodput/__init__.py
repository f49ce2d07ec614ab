"""What runs left behind, added up: where a job's wall time and GPU-hours went (read from its run folder, added
up, advised on, drawn) and a sweep's runs side by side."""
