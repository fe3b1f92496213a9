"""Hidden tests: copied into the workdir only for evaluation."""
