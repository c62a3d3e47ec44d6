"""The worker side's private modules, in each rank's worker process."""
