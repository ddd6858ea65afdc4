"""A periodic progress line for long loops: step, rate, ETA and the latest metrics."""
import time


class Progress:
    def __init__(self, name: str, total: int, every_s: float = 10.0):
        self.name, self.total, self.every_s = name, total, every_s
        self.start = self.last_print = time.time()

    def update(self, step: int, **metrics) -> None:
        """Call after finishing `step` (1-based); prints at most every `every_s` seconds, and at the end."""
        now = time.time()
        if step < self.total and now - self.last_print < self.every_s and step != 1:
            return
        self.last_print = now
        per_step = (now - self.start) / step
        eta = per_step * (self.total - step)
        shown = " ".join(f"{k}={v:.4g}" for k, v in metrics.items())
        print(f"[{self.name}] step {step}/{self.total} ({100 * step / self.total:.0f}%) {shown} | "
              f"{per_step:.2f} s/step | ETA {int(eta // 60)}m{int(eta % 60):02d}s", flush=True)
