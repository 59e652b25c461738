"""The echo plugin: returns its input text as JSON. No model; for dispatch tests and benchmarks.

It checkpoints like a model would (every ``ctx.checkpoint_every`` steps: the step reached)
and resumes from such a checkpoint, so fault-tolerance tests and benchmarks can use it."""
import json
import time

from plugins.api import BadInput, Output, Plugin


class Echo(Plugin):
    def setup(self, weights_dir, device):
        self.device = device

    def run(self, inputs, ctx):
        steps = inputs["steps"]
        per_step_s = inputs["sleep_ms"] / 1000 / steps
        every = int(getattr(ctx, "checkpoint_every", 0) or 0)
        start = 0
        resume = getattr(ctx, "resume_from", None)
        if resume:
            try:
                start = int(json.loads(resume)["echo_step"])
            except (ValueError, KeyError, TypeError):
                raise BadInput("resume_from is not an echo checkpoint", retryable=True) from None
            start = max(0, min(start, steps))
            ctx.progress(start, steps, "resumed from a checkpoint")
        words = inputs["text"].split(" ") if inputs.get("stream") else []
        pieces = [w if i == 0 else " " + w for i, w in enumerate(words)]
        for step in range(start + 1, steps + 1):
            deadline = time.monotonic() + per_step_s
            while True:
                ctx.check_cancelled()
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                time.sleep(min(left, 0.01))
            # the words due by this step (all of them by the last), as a model streams tokens
            for piece in pieces[len(pieces) * (step - 1) // steps:len(pieces) * step // steps]:
                ctx.stream(piece)
            if steps > 1:
                ctx.progress(step, steps)
            if every and step % every == 0 and step < steps:
                ctx.checkpoint(step, json.dumps({"echo_step": step}).encode())
        # A pure function of the inputs, like a model with a pinned seed: a check run of the
        # same job on another provider must return the same bytes (DESIGN §6).
        body = json.dumps({"text": inputs["text"]}).encode()
        return [Output(data=body, media_type="application/json")]
