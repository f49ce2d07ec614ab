"""Each GPU's peak memory for the bundled language model (hpcjobs.protocol.planning.lmsizes), before anything is queued,
and for a Hugging Face decoder described by its config.json (a Shape: hpcjobs.request.hf_config).

Torch-free arithmetic over the model's shapes and the trainer's settings. What a rank holds at its peak:
  weights      fp32 parameters: 4 bytes each, 1/ranks of them under fsdp (none on the GPU with --cpu-offload)
  gradients    fp32: 4 bytes a parameter (1/ranks under fsdp; under ddp over ranks all the step: DDP's buckets,
               which the gradients are views into, outlive zero_grad), plus an unsharded fp32 copy under fsdp while
               --grad-accum > 1 accumulates without --reduce-each-micro-batch
  AdamW        two fp32 moments: 8 bytes a parameter (1/ranks under fsdp)
  activations  what autograd saves for the backward, per block and token of the micro-batch, in units of the width d:
               the two LayerNorm inputs in the residual stream's dtype (2·r) and 15·c in the compute dtype: the
               LayerNorm outputs the matmuls keep (2), q, k, v (3), attention's output and its reshaped copy (2), the
               MLP's 4d pre-activation and GELU output (8). Under ddp with bf16 autocast the residual stays fp32
               (r = 4, c = 2: 38 bytes); under fsdp the parameters are cast, so r = c = 2 (34 bytes); fp32: 68.
               With --activation-checkpointing each block keeps only its input (r; --ac-mode selective: also its
               matmuls' and attention's outputs, in the compute dtype) and one block is recomputed
               at a time. Plus the head: ln_f's input and output and the fp32 log-softmax over the 256 bytes.
  working      ddp with autocast: the bf16 copies of the weights autocast makes, alive until the backward used them;
               fsdp: two gathered blocks (the last one again for its backward, the next prefetched) and the
               root's gathered embeddings, in the compute dtype; while a block's gradients are made, also its
               unsharded gradient and fp32 reduce-scatter input (at the end of the backward, and with activation
               checkpointing, where the block's own recomputed activations are what is saved)
  transient    the logits' gradient in bf16 beside the fp32 one at the start of the backward; a Hugging Face
               model's step peaks at the loss's backward: the log-softmax's and the logits' fp32 gradients
  headroom     on a GPU: 1.5 GiB for the CUDA context, cuBLAS workspaces and NCCL buffers, and 10% for the caching
               allocator's fragmentation (on an H200: reserved − allocated 0–3% of the peak, 12% for 1b fsdp
               without activation checkpointing)
The peak is the larger of the start of the backward (everything saved, no gradient yet) and its end (every gradient,
the first block's activations): gradients grow as saved activations are freed. A Hugging Face model with activation
checkpointing is planned phase by phase (checkpointed_moments: the loss's forward and backward, the last, second and
first block's backward, the fused AdamW step), as measured: its peak falls in any of the first five.
bench/memplan.py measured the tensors' part within 5% on real CPU ranks (small and medium, ddp and fsdp, fp32 and
bf16, with and without activation checkpointing) and on 7b's shapes under fake tensors (bench/results/memplan.json);
on an H200 the tensors' part was 1.00–1.05 × the measured peak allocated (1b ddp, fsdp, fsdp + AC, --cpu-offload;
7b fsdp + AC: 99.1 against 98.0 GiB) and the total 1.05–1.20 × the peak reserved
(bench/results/gpu-h200-acceptance.json). A Hugging Face model's plan (its Shape) against transformers' own models
on the CPU with the GPU's fused AdamW (bench/results/hf_memplan.json): 0.999–1.000 × the measured peak under ddp,
1.02–1.04 under fsdp, 0.98–1.05 with full or selective activation checkpointing (41 rows, worst 1.047).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from hpcjobs.protocol.planning.lmsizes import VOCAB, GPTConfig, block_params, n_params

GIB = 2**30
CONTEXT_BYTES = int(1.5 * GIB)
"""CUDA context, cuBLAS workspaces and NCCL's buffers: memory a GPU has that the caching allocator never gets."""
FRAGMENTATION = 0.10
"""The caching allocator's reserved-but-unallocated share at the peak (a rule of thumb for transformer training)."""
MAX_GPU_GIB = 1024 * 1024
"""The largest gpu_memory taken (1 PB: well past any GPU, and a finite number)."""
_GPU_MEMORY = re.compile(r"^(\d+(?:\.\d+)?)\s*(G|GB|GiB|T|TB|TiB)$", re.IGNORECASE)


def parse_gpu_memory(text: object, what: str = "gpu_memory") -> int:
    """Bytes in a GPU's memory as its maker states it (`80GB`, `141GB`, `80G`): GPU makers' GB are GiB (an 80GB
    H100 reports 81559 MiB). Raises ValueError saying what is valid (`what`: the profile key, for its parsers'
    signature)."""
    m = _GPU_MEMORY.match(str(text).strip()) if isinstance(text, (str, int, float)) else None
    gib = float(m.group(1)) * (1 if m.group(2)[0].upper() == "G" else 1024) if m else 0.0
    if not 0 < gib <= MAX_GPU_GIB:  # also a number too long for a float (inf)
        raise ValueError(f"a positive size in GB or TB of at most {MAX_GPU_GIB // 1024} TB, e.g. 80GB")
    return int(gib * GIB)


@dataclass(frozen=True)
class Setup:
    """The trainer's settings that decide the memory (TrainConfig's names), resolved: a precision, a micro-batch."""

    strategy: str = "ddp"
    ranks: int = 1
    micro_batch: int = 8
    seq_len: int = 2048
    precision: str = "bf16"
    """fp32, bf16 or fp16 (auto resolved: bf16 on GPUs)."""
    activation_checkpointing: bool = False
    ac_mode: str = "full"
    """With activation_checkpointing: full (each block keeps its input) or selective (also its matmuls' and
    attention's outputs, trainers/activations.py)."""
    grad_accum: int = 1
    reduce_each_micro_batch: bool = False
    cpu_offload: bool = False
    gpu: bool = True
    """On a GPU: the headroom counts; on the CPU the plan is the bytes of live tensors alone."""


@dataclass(frozen=True)
class Plan:
    """Bytes one rank holds at its peak, by kind; `total` includes the headroom."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    working: int
    transient: int
    headroom: int

    @property
    def tensors(self) -> int:
        return self.total - self.headroom

    @property
    def total(self) -> int:
        return sum(dataclasses.astuple(self))

    def as_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "total": self.total}

    def text(self) -> str:
        unit, size = ("GiB", GIB) if self.total >= GIB else ("MiB", 2**20)

        def g(n: int) -> str:
            return f"{n / size:.1f}"

        return (f"weights {g(self.weights)} + gradients {g(self.gradients)} + AdamW {g(self.optimizer)} + "
                f"activations {g(self.activations)} + working copies {g(self.working)} + transient "
                f"{g(self.transient)} + headroom {g(self.headroom)} = {g(self.total)} {unit}")


@dataclass(frozen=True)
class Saved:
    """What a block (or the head's final norm) keeps for its backward, per token, in elements, by the dtype each is
    kept in: `fp32` always fp32 (norm statistics, the input an RMSNorm upcasts), `stream` the residual stream's
    (fp32 under ddp and autocast, the compute dtype under fsdp's cast), `compute` the matmuls' dtype. `outs` are the
    norms' outputs, one copy each, except under autocast (a stream wider than the compute dtype), where every matmul
    that reads one casts its own copy: `cast_outs` (Llama's q, k, v read one norm, gate and up the other: 5 × d)."""

    fp32: int = 0
    stream: int = 0
    compute: int = 0
    outs: int = 0
    cast_outs: int = 0

    def bytes_per_token(self, r: int, c: int) -> int:
        return 4 * self.fp32 + r * self.stream + c * (self.compute + (self.cast_outs if r != c else self.outs))


@dataclass(frozen=True)
class Shape:
    """A decoder's sizes as the plan reads them: the bundled GPT's (`gpt_shape`) or a Hugging Face config's
    (hpcjobs.request.hf_config)."""

    n_layer: int
    n_head: int
    d_model: int
    """The residual stream's width (what a checkpointed block keeps a token)."""
    vocab: int
    params: int
    """All parameters (a tied output head counted once)."""
    block_params: int
    """One block's parameters (fsdp gathers a block at a time)."""
    cast_params: int
    """Parameters autocast copies to the compute dtype for its matmuls (ddp's working copies)."""
    block: Saved
    kept_selective: int
    """Elements a token a block keeps under selective checkpointing besides its input: the outputs of its matrix
    multiplications and attention's, in the compute dtype (the bundled GPT's qkv, proj, fc, out and attention:
    10·d)."""
    head: Saved
    """The final norm's saved tensors (the head's logits are counted from `vocab`)."""
    logits_peak: bool = False
    """The step peaks at the loss's backward: the log-softmax's fp32 gradient and the logits' (8 bytes a token and
    vocabulary entry) beside every saved activation, in fp32 and bf16 alike (HF models with 1K-3K vocabularies,
    bench/results/hf_memplan.json). The bundled GPT's 256-entry vocabulary peaks later, in the last block's backward,
    with the logits' bf16 gradient beside the fp32 one (bench/results/memplan.json)."""
    late_params: int = 0
    """Parameters whose gradients are made after the first block's backward: the input embeddings when untied (a
    tied head's gradient is made first), GPT-2's learned positions."""


def gpt_shape(c: GPTConfig) -> Shape:
    """The bundled GPT as a Shape: per block 2·d LayerNorm inputs in the stream's dtype, 15·d in the compute dtype
    (of which 2·d the LayerNorm outputs), 4 fp32 statistics; the head's ln_f input and output."""
    d = c.d_model
    return Shape(n_layer=c.n_layer, n_head=c.n_head, d_model=d, vocab=VOCAB, params=n_params(c),
                 block_params=block_params(c), cast_params=n_params(c),
                 block=Saved(fp32=4, stream=2 * d, compute=13 * d, outs=2 * d, cast_outs=2 * d), kept_selective=10 * d,
                 head=Saved(stream=d, outs=d, cast_outs=d))


def shape_of(c: GPTConfig | Shape) -> Shape:
    return c if isinstance(c, Shape) else gpt_shape(c)


def compute_bytes(s: Setup) -> int:
    """Bytes of an element the matmuls take: 2 in bf16/fp16 (autocast's or FSDP2's cast), else 4."""
    return 2 if s.precision in ("bf16", "fp16") else 4


def stream_bytes(s: Setup) -> int:
    """The residual stream's bytes an element: fsdp casts the parameters, autocast does not."""
    return compute_bytes(s) if s.strategy == "fsdp" else 4


def block_bytes(c: GPTConfig | Shape, s: Setup) -> int:
    """What one block saves for its backward (see the module's docstring), with its norms' statistics and
    attention's logsumexp."""
    m = shape_of(c)
    b, t = s.micro_batch, s.seq_len
    return b * t * m.block.bytes_per_token(stream_bytes(s), compute_bytes(s)) + b * m.n_head * t * 4


def kept_bytes(m: Shape, s: Setup) -> int:
    """What a checkpointed block keeps: its input; selective: its matmuls' and attention's outputs too."""
    b, t = s.micro_batch, s.seq_len
    kept = b * t * m.d_model * stream_bytes(s)
    return kept + (b * t * m.kept_selective * compute_bytes(s) + b * m.n_head * t * 4 if s.ac_mode == "selective"
                   else 0)


def activation_bytes(c: GPTConfig | Shape, s: Setup) -> tuple[int, int]:
    """(saved activations at the start of the backward, the transient gradients then) for one micro-batch."""
    m = shape_of(c)
    low, r = compute_bytes(s), stream_bytes(s)
    b, t = s.micro_batch, s.seq_len
    block = block_bytes(m, s)
    blocks = m.n_layer * kept_bytes(m, s) + block if s.activation_checkpointing else m.n_layer * block
    head = b * t * m.head.bytes_per_token(r, low) + b * t * m.vocab * 4 + b * (t + 1) * 8  # fp32 log-softmax, batch
    # at the loss's backward: the log-softmax's fp32 gradient and the logits' beside the saved log-probabilities
    transient = b * t * m.vocab * (8 if m.logits_peak else low if low < 4 else 0)
    return blocks + head, transient


def working_bytes(c: GPTConfig | Shape, s: Setup, backward: bool = False, root: bool = True) -> int:
    """Weights that exist only while the step runs (see the module's docstring); `backward`: while a block's
    gradients are made, under fsdp also its unsharded gradient and fp32 reduce-scatter input; `root`: the root's
    gathered embeddings too (not by the first block's backward: measured, HF models with 1K-3K vocabularies)."""
    m = shape_of(c)
    low = compute_bytes(s)
    if s.strategy == "ddp":
        return low * m.cast_params if low < 4 else 0
    block = m.block_params
    outer = m.params - m.n_layer * block
    # the last block gathered again for its backward, the next prefetched, the root's embeddings
    return 2 * low * block + low * outer * root + (block * (low + 4) if backward else 0)


def plan(c: GPTConfig | Shape, s: Setup) -> Plan:
    """One rank's peak (see the module's docstring for what each part is): the larger of the backward's start and
    its end. With activation checkpointing the start's peak is at the last block's backward: its activations
    recomputed, its gradients being made."""
    m = shape_of(c)
    shard = s.ranks if s.strategy == "fsdp" else 1
    on_device = 0 if s.strategy == "fsdp" and s.cpu_offload else 1
    weights, grads, optimizer = (on_device * k * m.params // shard for k in (4, 4, 8))
    unsharded = 4 * m.params if s.strategy == "fsdp" and s.grad_accum > 1 and not s.reduce_each_micro_batch else 0
    acts, transient = activation_bytes(m, s)
    # gradients of the earlier micro-batches; under ddp over ranks, DDP's buckets (the gradients are views into
    # them) outlive zero_grad: +4 bytes a parameter all the step (measured: small, 2 CPU ranks, 0.90 -> 1.00)
    kept = grads + unsharded if s.grad_accum > 1 or (s.strategy == "ddp" and s.ranks > 1) else unsharded
    if m.logits_peak and s.activation_checkpointing:
        moments = checkpointed_moments(m, s, Plan(weights, kept, optimizer, acts, 0, transient, 0), grads + unsharded)
    else:
        moments = [Plan(weights, kept, optimizer, acts, working_bytes(m, s, s.activation_checkpointing), transient, 0),
                   # the end: every gradient, the first block's activations and, under fsdp, its gradients reduced
                   Plan(weights, grads + unsharded, optimizer, block_bytes(m, s),
                        working_bytes(m, s, backward=True, root=False) if s.strategy == "fsdp" else 0, 0, 0)]
    peak = max(moments, key=lambda x: x.total)
    headroom = int(CONTEXT_BYTES + FRAGMENTATION * peak.total) if s.gpu else 0
    return dataclasses.replace(peak, headroom=headroom)


def checkpointed_moments(m: Shape, s: Setup, start: Plan, grads: int) -> list[Plan]:
    """A Hugging Face model's step with activation checkpointing, phase by phase (bench/memplan.py's two_steps
    records each phase's peak; bench/results/hf_memplan.json): `start` holds the weights, the gradients kept all the
    step, AdamW's moments, the saved activations (with one recomputed block) and the logits' gradients; `grads`
    every gradient. Under ddp with autocast the cast copies live in the forward only (autocast's cache, freed as it
    exits); in the backward a checkpointed block's recompute casts its own (and the head's matmul kept its)."""
    b, t, low = s.micro_batch, s.seq_len, compute_bytes(s)
    block = block_bytes(m, s)
    autocast = s.strategy == "ddp" and low < 4
    head = low * m.vocab * m.d_model if autocast else 0
    fsdp = s.strategy == "fsdp"
    return [
        # the loss in the forward: every cast copy, the logits (and their fp32 upcast) beside the log-softmax
        dataclasses.replace(start, activations=start.activations - block, working=working_bytes(m, s),
                            transient=b * t * m.vocab * (4 + (low if low < 4 else 0))),
        # the loss's backward: the log-softmax's and the logits' fp32 gradients, the recomputed block not yet there
        dataclasses.replace(start, activations=start.activations - block,
                            working=working_bytes(m, s) if fsdp else head),
        # block k's backward (k = n, 2, 1: between them the bytes change linearly)
        *(block_moment(m, s, start, grads, k) for k in sorted({m.n_layer, min(2, m.n_layer), 1})),
        # the optimizer's step (fused AdamW, as on GPUs: no temporaries): every gradient
        dataclasses.replace(start, gradients=grads, activations=0, working=0, transient=0)]


def block_moment(m: Shape, s: Setup, start: Plan, grads: int, k: int) -> Plan:
    """Block k's backward (k = 1 the first block): its activations recomputed, what blocks 1..k-1 kept, the
    gradients of the head and of the blocks after k made. Under fsdp the root (embeddings, head) stays gathered and
    its gradients unsharded until its own backward ends, the next block is prefetched (none before the first), and
    the block's unsharded gradient and fp32 reduce-scatter input are made; under ddp with autocast, the block's own
    cast copies; ddp counts the block's own gradients whole (made while its activations are freed)."""
    low = compute_bytes(s)
    outer = m.params - m.n_layer * m.block_params
    acts = (k - 1) * kept_bytes(m, s) + block_bytes(m, s)  # block k keeps what it saved among its activations
    if s.strategy == "fsdp":
        gathered = (2 if k > 1 else 1) * low * m.block_params + m.block_params * (low + 4)
        root = low * outer + low * (outer - m.late_params)
        return dataclasses.replace(start, gradients=max(start.gradients, 4 * (m.n_layer - k) * m.block_params
                                                         // s.ranks), activations=acts, working=gathered + root,
                                   transient=0)
    cast = low * m.block_params if low < 4 else 0
    made = grads - 4 * m.late_params - 4 * (k - 1) * m.block_params
    return dataclasses.replace(start, gradients=max(start.gradients, made), activations=acts, working=cast,
                               transient=0)


def suggestions(c: GPTConfig | Shape, s: Setup, gpu_bytes: int, gpus_per_node: int, most_nodes: int) -> list[str]:
    """Flags that would make `s` fit `gpu_bytes`, the smallest change first: the other strategy, activation
    checkpointing, a smaller batch, more nodes (fsdp shards over them); at most three."""
    tries: list[tuple[str, Setup]] = []
    fsdp = dataclasses.replace(s, strategy="fsdp")
    if s.strategy == "ddp":
        tries.append(("--strategy fsdp", fsdp))
    if s.activation_checkpointing and s.ac_mode == "selective":
        tries.append(("--ac-mode full", dataclasses.replace(s, ac_mode="full")))
    if not s.activation_checkpointing:
        tries.append(("--activation-checkpointing", dataclasses.replace(s, activation_checkpointing=True)))
        if s.strategy == "ddp":
            tries.append(("--strategy fsdp --activation-checkpointing",
                          dataclasses.replace(fsdp, activation_checkpointing=True)))
    batch = s.micro_batch // 2
    while batch >= 1:
        tries.append((f"--batch-size {batch * s.grad_accum}", dataclasses.replace(s, micro_batch=batch)))
        batch //= 2
    nodes = max(1, s.ranks // gpus_per_node) * 2
    while nodes <= most_nodes:
        ranks = nodes * gpus_per_node
        tries.append((f"--nodes {nodes}" + (" --strategy fsdp" if s.strategy == "ddp" else ""),
                      dataclasses.replace(fsdp, ranks=ranks)))
        nodes *= 2
    fits = [flags for flags, t in tries if plan(c, t).total <= gpu_bytes]
    return list(dict.fromkeys(fits))[:3]
