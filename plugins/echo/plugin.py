"""The echo plugin: returns its input as JSON. No model; for dispatch tests and benchmarks."""
import json
import time

from plugins.api import Output, Plugin


class Echo(Plugin):
    def setup(self, weights_dir, device):
        self.device = device

    def run(self, inputs, ctx):
        steps = inputs["steps"]
        per_step_s = inputs["sleep_ms"] / 1000 / steps
        for step in range(1, steps + 1):
            deadline = time.monotonic() + per_step_s
            while True:
                ctx.check_cancelled()
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                time.sleep(min(left, 0.01))
            if steps > 1:
                ctx.progress(step, steps)
        body = json.dumps({"text": inputs["text"], "job_id": ctx.job_id}).encode()
        return [Output(data=body, media_type="application/json")]
