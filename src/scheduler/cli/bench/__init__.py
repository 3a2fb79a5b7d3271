"""Load generation: datasets, targets, runner, report and plots (`mlx-scheduler bench`)."""
