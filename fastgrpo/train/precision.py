"""Mixed precision that learns: compute in bf16, step fp32 master weights with fp32 moments.

Why: AdamW moves each weight by about the learning rate. At lr 1e-5 that is below half a bf16 ulp
for most weights (the ulp is 1.2e-4 at |w| = 0.03), so an update applied to bf16 parameters in
place rounds away: the default job on a GPU went 0.265 -> 0.29 held-out accuracy in 30 steps,
where the same job in fp32 reached 0.51 (issue 26). torch's AdamW also keeps its moments in the
parameter's dtype, so a bf16 model had bf16 moments too.

How: the model keeps its bf16 (or fp16) parameters; the rollout engine and the kernels read those
very tensors, zero-copy. AdamW steps fp32 copies of them (the masters, views of one flat buffer)
and keeps its moments beside the masters, in fp32. Each optimizer step:
  1. casts the gradients autograd accumulated on the bf16 parameters into fp32 gradient buffers
     that exist only during the step (one multi-tensor copy; the buffers are views of one flat
     allocation whose storage is freed again afterwards, so they add nothing to the peak memory of
     the backward passes);
  2. clips the fp32 gradients and steps AdamW on the masters;
  3. refreshes the bf16 parameters from the masters, by default with stochastic rounding (three
     passes over the flat buffer and one multi-tensor copy; `refresh` says why), no
     per-parameter Python loop.
Gradients accumulate across micro-batches in bf16, in autograd: on the real model that adds
0.2-0.35% of error to a gradient whose bf16 compute already carries 4-6%
(benchmarks/lab/bench_grad_accumulation.py, results/grad_accumulation_*.json), while an fp32 buffer
alive through every backward would cost 4 bytes a parameter at the peak.
"""

from __future__ import annotations

import torch

MODES = ("auto", "fp32", "off")
ROUNDINGS = ("stochastic", "nearest")  # how the bf16 weights are rounded from the masters
LOW_PRECISION = (torch.bfloat16, torch.float16)
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}  # stored bits, the leading 1 not counted


class MasterWeights:
    """fp32 masters of a model's low-precision parameters, for the optimizer to step instead."""

    def __init__(
        self, params: list[torch.nn.Parameter], rounding: str = "stochastic", seed: int = 0
    ):
        if not params:
            raise ValueError("MasterWeights needs at least one parameter")
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding is {rounding!r}; choose one of {', '.join(ROUNDINGS)}")
        self.params = list(params)  # the model's bf16/fp16 parameters, read by every kernel
        # stochastic rounding works on the bits of bf16's fp32 twin; fp16 rounds to nearest
        self.stochastic = rounding == "stochastic" and all(
            p.dtype == torch.bfloat16 for p in self.params
        )
        sizes = [p.numel() for p in self.params]
        device = self.params[0].device
        # The masters are views of one flat fp32 buffer (one pass rounds them all), and each
        # is an nn.Parameter, a leaf the optimizer accepts; its .grad is a view set up once.
        self._flat = torch.cat([p.detach().float().flatten() for p in self.params])
        self.masters = [
            torch.nn.Parameter(view.view_as(p))
            for p, view in zip(self.params, self._flat.split(sizes))
        ]
        self._grad_flat = torch.empty(sum(sizes), dtype=torch.float32, device=device)
        for master, view in zip(self.masters, self._grad_flat.split(sizes)):
            master.grad = view.view_as(master)
        self._grad_storage = self._grad_flat.untyped_storage()
        self._grad_bytes = self._grad_storage.nbytes()
        self._grad_storage.resize_(0)  # allocated only while a step runs
        self._grads = [m.grad for m in self.masters]
        self._some_without_gradient = False  # load_gradients' slow path ran this step
        # the stochastic rounding's own random stream: the same on every rank of a job (the
        # bf16 weights must not drift apart) and independent of what the rollouts draw
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def open_gradients(self) -> torch.Tensor:
        """Allocate the fp32 gradient buffer and return it, for a caller that fills it (a
        replicated job's all-reduce, `distributed/replicated.py`) instead of `load_gradients`."""
        self._grad_storage.resize_(self._grad_bytes)
        return self._grad_flat

    def load_gradients(self, grads: list | None = None) -> bool:
        """Cast the parameters' gradients (or `grads`, one per parameter) into the masters'
        fp32 gradients; False when no parameter has one (nothing to step). A parameter without
        a gradient gets none: AdamW leaves it alone, as it would the parameter itself."""
        grads = [p.grad for p in self.params] if grads is None else grads
        present = [g is not None for g in grads]
        if not any(present):
            return False
        self._grad_storage.resize_(self._grad_bytes)
        if all(present):
            torch._foreach_copy_(self._grads, grads)
        else:  # rare (a parameter outside this loss): the slow path
            for master, view, grad in zip(self.masters, self._grads, grads):
                master.grad = None if grad is None else view.copy_(grad)
            self._some_without_gradient = True
        return True

    def release_gradients(self) -> None:
        """Free the fp32 gradient buffers (after the optimizer step)."""
        if self._some_without_gradient:  # put back what load_gradients' slow path took away
            for master, view in zip(self.masters, self._grads):
                master.grad = view
            self._some_without_gradient = False
        self._grad_storage.resize_(0)

    @torch.no_grad()
    def refresh(self) -> None:
        """Round the masters into the model's parameters, in place (the tensors the engine reads).

        Stochastic rounding (bf16): each master rounds up with probability equal to its distance
        from the bf16 below, so the bf16 weights equal the masters in expectation. Rounding to
        nearest instead leaves a weight unchanged until its master has moved half an ulp: at lr
        1e-5, 30 steps moved 10% of the 135M model's matrix entries and 1% of its norm gains, and
        the masters drifted on with no feedback (evaluated in fp32 they scored 0.34 where their
        bf16 rounding scored 0.48). Stochastic rounding learned more: 0.520 against 0.486 held-out
        accuracy, 6 seeds each (benchmarks/results/bf16_rounding_ab_h200.txt).
        The gradient buffer, free between steps, holds the rounded values on their way.
        """
        allocated = self._grad_storage.nbytes() != 0
        if not allocated:
            self._grad_storage.resize_(self._grad_bytes)
        if self.stochastic:  # bf16 is fp32's upper half: add 16 random low bits, then cut them
            bits = self._grad_flat.view(torch.int32)
            bits.random_(0, 1 << 16, generator=self.generator)
            bits.add_(self._flat.view(torch.int32)).bitwise_and_(-(1 << 16))
            torch._foreach_copy_(self.params, self._grads)  # exact: the low bits are zero
        else:
            torch._foreach_copy_(self.params, self.masters)
        if not allocated:
            self._grad_storage.resize_(0)

    def state_dict(self) -> list[torch.Tensor]:
        return [m.detach() for m in self.masters]

    @torch.no_grad()
    def load_state_dict(self, masters: list[torch.Tensor]) -> None:
        if len(masters) != len(self.masters) or any(
            a.shape != b.shape for a, b in zip(masters, self.masters)
        ):
            raise ValueError(
                "the checkpoint's master weights do not match this model's parameters; "
                "resume with the model and config the run was started with"
            )
        # the bf16 weights stay as they are: a checkpoint's model holds the masters' rounding
        torch._foreach_copy_(self.masters, [m.to(self.masters[0].device) for m in masters])


def wants_masters(mode: str, params: list[torch.Tensor]) -> bool:
    """Whether `train.master_weights` = mode gives these parameters fp32 masters."""
    if mode not in MODES:
        raise ValueError(f"master_weights is {mode!r}; choose one of {', '.join(MODES)}")
    low = any(p.dtype in LOW_PRECISION for p in params)
    return low and mode != "off"


@torch.no_grad()
def rounded_away_fraction(params: list[torch.Tensor], learning_rate: float) -> float:
    """The fraction of low-precision weights for which a step of `learning_rate` (AdamW's usual
    step size) is below half an ulp, so that updating them in place leaves them unchanged."""
    below, total = 0, 0
    for p in params:
        if p.dtype not in LOW_PRECISION:
            continue
        mantissa_bits = MANTISSA_BITS[p.dtype]
        w = p.detach().float()
        _, exponent = torch.frexp(w)  # |w| in [2^(e-1), 2^e)
        half_ulp = torch.ldexp(torch.ones_like(w), exponent - mantissa_bits - 2)
        below += int(((learning_rate < half_ulp) & (w != 0)).sum())
        total += p.numel()
    return below / total if total else 0.0
