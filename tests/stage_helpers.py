"""A stand-in tracker for tests that drive a stage's workers without its job."""


class Tracker:
    """Stands in for a stage's MLflow run (runtime/tracking.py, StageRun): no checkpoints, nothing logged."""
    checkpoint_dir = None

    def __init__(self):
        self.placements: list[dict] = []

    def record_placements(self, placements: list[dict]) -> None:
        self.placements.extend(placements)

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        pass

    def set_tags(self, tags: dict) -> None:
        pass
