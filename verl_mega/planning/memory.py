"""Per-rank memory, FLOPs and bytes moved of one RL step, from the run's config and the HF config.json alone.

Nothing here has been measured on a GPU: these are the formulas below, applied to the layout the config names.
All figures are per rank; the GPU memory unit is the GiB (2**30 bytes). e is the bytes of an activation (the
model dtype's: 2 for bf16/fp16, 4 for fp32), s the sequence length (data.max_prompt_length +
data.max_response_length), b the micro-batch's rows, h hidden_size, a the attention heads, g the key/value heads,
d head_dim, f ffn_hidden_size, t the tensor-parallel size, p the pipeline-parallel size, D the data-parallel size,
V the padded vocabulary.

Parameters, gradients, optimizer state (Megatron-LM's distributed-optimizer table): each parameter costs its own
bytes and its gradient's, held whole by every DP rank, plus fp32 main parameters (when the parameters are not
fp32), fp32 main gradients (when the gradients are not fp32) and Adam's two fp32 moments, which the distributed
optimizer shards over the D ranks: fp16 params + fp16 grads 20 B (4 + 16/D distributed), bf16 params + fp32
grads 18 B (6 + 12/D), fp32 + fp32 16 B (8 + 8/D). verl_mega's DDP reduces gradients in fp32
(`grad_reduce_in_fp32=True` in `roles.trainable`), so a bf16/fp16 model takes the 18 B row, an fp32 one the
16 B row. With `optim.cpu_offload` the optimizer's part (main parameters, main gradients, moments) is on the host.
Across the rollout window the actor holds what `actor.offload` leaves (`rollout.training_memory`): without its
gradient buffers (grads) and Adam's moments (optimizer), and in the rollout, once the engine has its copy,
without its parameters and fp32 main parameters (params); the critic holds what `critic.offload` leaves (by
default all of it). A reference of its own holds its weights in its own pass only with `actor.offload.params`
(verl's ref param_offload: they wait on the host otherwise, `roles.reference`), else always; outside the window
the critic holds everything. A distillation teacher (`roles.teacher`, frozen, never offloaded) holds its weights
in the model dtype at its own layout (teacher.tp / teacher.pp, else the actor's) through the whole step: each
teacher's largest stage is counted on every rank (an upper bound where the teacher's pipeline stages differ from
the actor's), and its pass adds one layer's activations and its logits at its layout.

Activations per layer and micro-batch: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", Table 2) count, for a GPT layer in fp16 with a 4h GeLU MLP, dropout and a heads,
sbh(34 + 5as/h) bytes; 10sbh of it (the two LayerNorm inputs, the attention and MLP inputs, the two dropout
masks) are not split by tensor parallelism, the other 24sbh and the 5as^2b of the attention core are. Sequence
parallelism splits the 10sbh too; selective recompute drops the 5as^2b; full recompute keeps the layer's input,
2sbh. `korthikanti_shape` reproduces that table (tests/test_memory_planner.py). verl_mega's layers
(`models.builder`) differ, and so does the count (`layer_activation_bytes`, in bytes):
- RMSNorm instead of LayerNorm: it keeps its input as LayerNorm does, e*sbh each (the same term);
- no dropout (hidden_dropout = attention_dropout = 0): the two sbh masks and the as^2b mask go, and the core's
  probabilities are kept once (no dropout output beside them);
- GQA: Q is e*sb*a*d, K and V e*sb*g*d each where Korthikanti has 3 x e*sbh; megatron's local (unfused)
  attention repeats K and V to a heads before the product, so there they count a heads;
- the attention core: with flash attention (transformer-engine, the GPU layer spec) no s^2 matrix is kept,
  only the fp32 log-sum-exp, 4*asb; unfused, the softmax runs in fp32 (`attention_softmax_in_fp32`), so a 16-bit
  model keeps the fp32 probabilities (4*as^2b, softmax's output for its backward) and their 16-bit cast (e*as^2b,
  the input of the product with V);
- RoPE, unfused (models.builder sets apply_rope_fusion=False): the fused QKV projection's output stays whole while
  the rotary inputs view it, e*sb(a+2g)d, and rotate_half's Q and K are kept, e*sb(a+g)d;
- SwiGLU with f = ffn_hidden_size: fc1's output is [gate, up], 2f wide, kept for silu and the product; silu's
  output (f) and the product (f, fc2's input) are kept too: e*sb*4f, where the 4h GeLU MLP keeps e*sb*2f (8sbh).
  MoE layers: each token passes top_k experts of moe_intermediate_size plus the shared experts, counted as one
  SwiGLU of that total width; the router, the token-dispatch buffers and MLA's latent projections are not
  modelled (a note says so in every MoE or MLA plan).
Once per rank and pass beside those: unfused attention's scores buffer (megatron's global memory buffer, e*as^2b/t,
kept after the first forward) and, in an update, the backward's working set: the larger of the logits' gradient
and a layer's SwiGLU input gradients (2e*sbf/t), or under selective recompute with unfused attention the attention
core run again with its probabilities' gradient (measured on CPU: bench/planner_grid).
With pipeline parallelism under 1F1B, stage i holds min(p - i, m) micro-batches' activations when its m
micro-batches are under way (the first stage holds p of them: p micro-batches of L/p layers, a whole model's
worth); with v virtual stages (the interleaved schedule), (p - 1 - i)*2 + (v - 1)*p + 1 chunk forwards of L/(pv)
layers. Context parallelism (cp = c) splits every layer's activations over c ranks (s/c tokens each); the last
stage gathers the sequence back before the output layer, so the logits stay whole on every CP rank
(`roles.megatron_step._output_layer_at`).
Full recompute (`actor.recompute`): uniform keeps one layer input per chunk of num_layers layers, block the inputs
of the stage's first num_layers layers and the others' whole activations, for each micro-batch in flight; the
chunk (uniform) or layer (block) being recomputed is held once per stage.

Logits (the last stage): the output layer's [s, b, V/t] logits stay in the model dtype (`roles.logprobs`:
`ops.token_logprobs` accumulates in fp32 and keeps the logits themselves for its backward, without an fp32
copy), e*sbV/t kept; in an update their gradient, as much again, at the start of the backward (the backward's
working set above, when it is the larger).

The rollout engine (vLLM) holds its weights at parallel.rollout_tp (the HybridEngine planner's per-rank bytes)
and a KV cache: on a GPU of known size it takes rollout.gpu_memory_utilization of it, weights included; otherwise
the KV cache of the batch's sequences at full length, split over rollout_tp (`kv_cache_bytes`). The transition
from training to rollout holds vLLM's weights and the planner's transfer buffers before the KV cache exists.
A quantized rollout (rollout.quantization int8 / fp8) holds its linear weights at 1 byte per element plus their
fp32 scales (the transition plan's rollout bytes); its KV cache stays in the rollout dtype (fp8 KV caches are not
in this project's rollouts), so the KV cache is counted as before.

FLOPs of the step (every sequence at full length: an upper bound): a forward over T tokens is
F = T(2N + 2hV) + (T/s) * 4Lds^2a, N the parameters outside embedding and output layer (an MoE layer's routed
experts counted top_k / num_experts), 4Lds^2a the attention products (QK^T and AV over the whole square; causal
kernels skip about half). A training pass is 3F, 4F with full recompute. The step: generation F, the old
log-probs, the reference's log-probs and the critic's values F each, the actor's and critic's updates 3F (4F)
per epoch.

Bytes moved per rank and step: the HybridEngine transition's send/receive (`rollout.planner`); per optimizer
step, the gradient all-reduce, 2(D-1)/D x 4 bytes per parameter of the rank (ring), or with the distributed
optimizer a reduce-scatter of the fp32 gradients ((D-1)/D x 4) and an all-gather of the parameters
((D-1)/D x e).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from verl_mega.config.schema import OffloadConfig, RecomputeConfig, TrainConfig
from verl_mega.models import load_hf_model_config
from verl_mega.models.builder import DTYPES, padded_vocab_size
from verl_mega.models.expected_shapes import expected_hf_shapes
from verl_mega.models.hf_config import HFModelConfig
from verl_mega.rollout.planner import Plan, plan as transition_plan
from verl_mega.rollout.vllm_engine import kv_cache_bytes

GIB = 2**30
GRAD_BYTES = 4  # DDP reduces gradients in fp32 (roles.trainable: grad_reduce_in_fp32=True)
FP32_BYTES = 4
ADAM_MOMENTS = 2
FLASH = "flash"
ATTENTION_KERNELS = (FLASH, "unfused")
# Cheapest first: recompute costs compute, then model-parallel ranks cost communication.
RECOMPUTE_COST = {"none": 0, "selective": 1, "full": 2}


def optimizer_bytes_per_parameter(param_bytes: int, grad_bytes: int, distributed: bool, dp: int) -> dict[str, float]:
    """Bytes per parameter on one rank: {'params', 'grads', 'optimizer'} (main params, main grads, Adam moments;
    sharded over `dp` with the distributed optimizer)."""
    main_params = FP32_BYTES if param_bytes != FP32_BYTES else 0
    main_grads = FP32_BYTES if grad_bytes != FP32_BYTES else 0
    sharded = main_params + main_grads + ADAM_MOMENTS * FP32_BYTES
    return {"params": param_bytes, "grads": grad_bytes, "optimizer": sharded / (dp if distributed else 1)}


@dataclass(frozen=True)
class LayerShape:
    """What a transformer layer keeps for its backward depends on: its sizes and kernels."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    gated: bool = True  # SwiGLU ([gate, up] = 2f wide) rather than one f-wide GeLU
    dropout: bool = False
    softmax_fp32: bool = True  # unfused attention: megatron's attention_softmax_in_fp32
    flash: bool = True  # a fused attention kernel keeps no s^2 matrix
    unfused_rope: bool = True  # models.builder's apply_rope_fusion=False: RoPE's inputs and rotate_half kept


def korthikanti_shape(hidden: int, heads: int) -> LayerShape:
    """The layer Korthikanti et al.'s Table 2 counts: 4h GeLU MLP, dropout, full multi-head attention, fp16
    softmax, unfused."""
    return LayerShape(hidden, heads, heads, hidden // heads, 4 * hidden, gated=False, dropout=True,
                      softmax_fp32=False, flash=False, unfused_rope=False)


def model_layer_shape(hf_config: HFModelConfig, attention: str = FLASH) -> LayerShape:
    """verl_mega's layer for this model; an MoE layer's MLP as one SwiGLU as wide as the experts a token visits."""
    ffn, raw = hf_config.ffn_hidden_size, hf_config.raw
    if hf_config.num_experts:
        expert = raw.get("moe_intermediate_size") or ffn
        shared = raw.get("shared_expert_intermediate_size") or expert * raw.get("n_shared_experts", 0)
        ffn = hf_config.moe_top_k * expert + shared
    # MLA: queries and keys are qk_nope + qk_rope wide per head (values narrower: counted as wide).
    head_dim = raw.get("qk_nope_head_dim", 0) + raw.get("qk_rope_head_dim", 0) or hf_config.head_dim
    return LayerShape(hf_config.hidden_size, hf_config.num_heads, hf_config.num_kv_heads, head_dim, ffn,
                      flash=attention == FLASH)


def layer_activation_bytes(shape: LayerShape, seq: int, batch: int, tp: int, sp: bool, selective: bool,
                           act_bytes: int) -> float:
    """Bytes one layer keeps for its backward, per rank (see the module's docstring for each term)."""
    tokens = seq * batch
    e, a, d = act_bytes, shape.heads, shape.head_dim
    # Whole on every TP rank unless sequence parallel: both norms' inputs, the QKV and fc1 inputs, dropout masks.
    replicated = 4 * e * tokens * shape.hidden + (2 * tokens * shape.hidden if shape.dropout else 0)
    kv = shape.kv_heads if shape.flash else a  # the local attention repeats K, V to every head
    attention = e * tokens * d * (a + 2 * kv) + e * tokens * a * d  # Q, K, V; the output projection's input
    if shape.unfused_rope:  # the fused QKV output the rotary inputs view, and rotate_half's Q and K
        attention += e * tokens * d * ((a + 2 * shape.kv_heads) + (a + shape.kv_heads))
    mlp = e * tokens * shape.ffn * (4 if shape.gated else 2)
    if selective:
        core = 0
    elif shape.flash:
        core = FP32_BYTES * a * tokens  # the softmax's log-sum-exp
    else:
        probs = e + (FP32_BYTES if shape.softmax_fp32 and e < FP32_BYTES else 0)
        core = a * seq * tokens * (probs + (1 + e if shape.dropout else 0))  # + the dropout mask and output
    return replicated / (tp if sp else 1) + (attention + mlp + core) / tp


def attention_buffer_bytes(shape: LayerShape, seq: int, batch: int, tp: int, act_bytes: int) -> float:
    """Unfused attention computes the scores into megatron's global memory buffer, e*as^2b/t, allocated at the
    first forward and kept by the process; a fused kernel has none."""
    return 0.0 if shape.flash else act_bytes * shape.heads * seq * seq * batch / tp


def backward_working_bytes(shape: LayerShape, seq: int, batch: int, tp: int, selective: bool,
                           act_bytes: int) -> float:
    """The most a layer's backward allocates beside what the forward kept (measured on CPU, bench/planner_grid):
    the SwiGLU's two f-wide input gradients (fc1's [gate, up] output's), or under selective recompute with unfused
    attention the attention core run again and its probabilities' gradient."""
    tokens, e = seq * batch, act_bytes
    mlp = e * tokens * shape.ffn * (2 if shape.gated else 1) / tp
    if not (selective and not shape.flash):
        return mlp
    probs = e + (FP32_BYTES if shape.softmax_fp32 and e < FP32_BYTES else 0)
    return max(mlp, shape.heads * seq * tokens * (probs + e) / tp)


def layer_input_bytes(shape: LayerShape, seq: int, batch: int, tp: int, sp: bool, act_bytes: int) -> float:
    """What full recompute keeps of a layer: its input (split over TP with sequence parallelism)."""
    return act_bytes * seq * batch * shape.hidden / (tp if sp else 1)


def stage_activation_bytes(shape: LayerShape, layers: int, seq: int, batch: int, tp: int, sp: bool,
                           recompute: RecomputeConfig, act_bytes: int) -> float:
    """One micro-batch's activations on a pipeline stage of `layers` layers, under `recompute`."""
    kept = functools.partial(layer_activation_bytes, shape, seq, batch, tp, sp, act_bytes=act_bytes)
    if recompute.granularity == "none":
        return layers * kept(selective=False)
    if recompute.granularity == "selective":
        return layers * kept(selective=True)
    whole, given = kept(selective=False), layer_input_bytes(shape, seq, batch, tp, sp, act_bytes)
    chunk = min(recompute.num_layers, layers)
    if recompute.method == "uniform":  # a chunk's input each, and one chunk rebuilt during the backward
        return math.ceil(layers / chunk) * given + chunk * whole
    return chunk * given + (layers - chunk) * whole + (whole if chunk else 0)


def rebuilt_bytes(shape: LayerShape, layers: int, seq: int, batch: int, tp: int, sp: bool,
                  recompute: RecomputeConfig, act_bytes: int) -> float:
    """The part of `stage_activation_bytes` that full recompute rebuilds during the backward: one chunk at a time
    on the stage, so held once however many micro-batches are in flight."""
    if recompute.granularity != "full":
        return 0.0
    whole = layer_activation_bytes(shape, seq, batch, tp, sp, False, act_bytes)
    chunk = min(recompute.num_layers, layers)
    return chunk * whole if recompute.method == "uniform" else (whole if chunk else 0.0)


def in_flight_micro_batches(stage: int, pp: int, micro_batches: int, vpp: int = 1) -> float:
    """Micro-batches' worth of a whole stage's activations that pipeline rank `stage` holds at once under 1F1B; with
    `vpp` virtual stages (megatron's interleaved schedule) the warm-up runs (p - 1 - stage) * 2 + (vpp - 1) * p
    chunk forwards before the first backward, each over 1/vpp of the rank's layers, and the steady state one more
    (every forward first when there are only p micro-batches)."""
    if vpp == 1:
        return min(pp - stage, micro_batches)
    chunks = micro_batches * vpp
    warmup = chunks if micro_batches == pp else min((pp - 1 - stage) * 2 + (vpp - 1) * pp, chunks)
    return min(warmup + 1, chunks) / vpp


def logits_bytes(seq: int, batch: int, padded_vocab: int, tp: int, act_bytes: int) -> float:
    """The last stage's vocabulary-parallel logits (or their gradient)."""
    return act_bytes * seq * batch * padded_vocab / tp


@dataclass(frozen=True)
class Layout:
    """What a plan varies: the training layout and the knobs that trade memory for time."""

    gpus: int
    tp: int
    pp: int
    ep: int
    rollout_tp: int
    sequence_parallel: bool
    distributed_optimizer: bool
    recompute: RecomputeConfig
    micro_batch: int
    cp: int = 1
    vpp: int = 1
    offload: OffloadConfig = dataclasses.field(default_factory=OffloadConfig)  # the actor's, in the rollout window
    cpu_offload: bool = False  # the actor's optimizer on the host (actor.optim.cpu_offload)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    def describe(self) -> str:
        recompute = self.recompute.granularity
        if recompute == "full":
            recompute += f"/{self.recompute.method}/{self.recompute.num_layers}"
        extra = "".join(f" {name}={value}" for name, value in (("cp", self.cp), ("vpp", self.vpp)) if value > 1)
        offloaded = [part for part in ("params", "grads", "optimizer") if getattr(self.offload, part)]
        extra += f" offload={'+'.join(offloaded) or 'none'}" + (" optim_cpu_offload=on" if self.cpu_offload else "")
        return (f"tp={self.tp} pp={self.pp} dp={self.dp}{extra} ep={self.ep} rollout_tp={self.rollout_tp} "
                f"sp={'on' if self.sequence_parallel else 'off'} recompute={recompute} "
                f"distributed_optimizer={'on' if self.distributed_optimizer else 'off'} micro_batch={self.micro_batch}")


def layout_of(config: TrainConfig, gpus: int | None = None) -> Layout:
    """The config's layout on `gpus` ranks (None: one data-parallel replica, tp x pp)."""
    p = config.parallel
    sp = p.tp > 1 if p.sequence_parallel is None else p.sequence_parallel
    return Layout(gpus or p.tp * p.pp * p.cp, p.tp, p.pp, p.ep, p.rollout_tp, sp,
                  config.actor.optim.use_distributed_optimizer, config.actor.recompute, config.actor.micro_batch_size,
                  p.cp, p.vpp, config.actor.offload, config.actor.optim.cpu_offload)


@dataclass(frozen=True)
class Roles:
    """The models a step runs besides the actor (trainer.rl.needs decides)."""

    critic: bool
    reference: bool
    teachers: tuple[str, ...] = ()  # the folders of the distillation teachers' config.json


class Model:
    """The HF config read once, with the HybridEngine plans of the layouts asked about."""

    def __init__(self, config: TrainConfig):
        self.config = config
        self.hf_config, self.family = load_hf_model_config(config.model.hf_path, config.model.family_spec or None)
        self.act_bytes = DTYPES[config.model.dtype].itemsize
        self.rollout_dtype = rollout_dtype(config)
        self._plans: dict[tuple[int, ...], Plan] = {}
        self._teachers: dict[str, Model] = {}

    def teacher(self, folder: str) -> "Model":
        """The model of a distillation teacher whose config.json is in `folder`, planned with this run's data and
        dtype (its family read from its own config)."""
        if folder not in self._teachers:
            model = dataclasses.replace(self.config.model, hf_path=folder, family_spec="")
            self._teachers[folder] = Model(dataclasses.replace(self.config, model=model))
        return self._teachers[folder]

    def transition(self, layout: Layout) -> Plan:
        # The CP ranks of a replica hold its weights as DP ranks do.
        key = (layout.tp, layout.pp, layout.dp * layout.cp, layout.ep, layout.rollout_tp)
        if key not in self._plans:
            self._plans[key] = transition_plan(
                self.config.model.hf_path, layout.tp, layout.pp, layout.dp * layout.cp, layout.rollout_tp,
                ep=layout.ep, dtype=self.rollout_dtype, family_spec=self.config.model.family_spec or None,
                quantization=self.config.rollout.quantization)
        return self._plans[key]

    def stage_parameters(self, layout: Layout) -> list[int]:
        """Parameters of the largest rank of each pipeline stage (the planner's shards, vocabulary padded)."""
        itemsize = DTYPES[self.rollout_dtype].itemsize
        stages = [0] * layout.pp
        for rank in self.transition(layout).ranks:
            stage = rank.coordinates.pp_rank
            stages[stage] = max(stages[stage], rank.train_bytes // itemsize)
        return stages

    @functools.cached_property
    def active_parameters(self) -> float:
        """N of the FLOPs: parameters outside embedding and output layer, routed experts by top_k / experts."""
        hf = self.hf_config
        share = hf.moe_top_k / hf.num_experts if hf.num_experts else 1.0
        total = 0.0
        for name, shape in expected_hf_shapes(hf, self.family).items():
            if "embed_tokens" in name or "lm_head" in name:
                continue
            routed = ".experts." in name and "shared_expert" not in name
            total += math.prod(shape) * (share if routed else 1.0)
        return total

    def notes(self) -> list[str]:
        found = []
        if self.hf_config.num_experts:
            found.append("MoE: expert MLP activations are counted as top_k experts' SwiGLU; the router and the "
                         "token-dispatch buffers are not modelled")
        if self.family.mla:
            found.append("MLA: attention activations are counted as GQA's with the config's heads and head_dim; the "
                         "latent projections are not modelled")
        return found


def teacher_layout_beside(config: TrainConfig, layout: Layout) -> Layout:
    """A distillation teacher's layout beside the actor's `layout`: teacher.tp / teacher.pp (null: the actor's),
    the rest of the ranks data-parallel, without pipeline interleaving or context parallelism (the teacher's
    groups, `parallel.layout_groups`); an MoE teacher's experts are planned unsplit (EP 1: an upper bound)."""
    tp, pp = config.teacher.tp or layout.tp, config.teacher.pp or layout.pp
    if layout.gpus % (tp * pp):
        raise ValueError(f"teacher tp={tp} x pp={pp} does not divide the {layout.gpus} ranks")
    sp = layout.sequence_parallel if tp == layout.tp else tp > 1
    return dataclasses.replace(layout, tp=tp, pp=pp, ep=1, rollout_tp=tp, sequence_parallel=sp, cp=1, vpp=1)


def rollout_dtype(config: TrainConfig) -> str:
    """What the rollout engine runs: rollout.dtype, or for auto bf16 under vLLM (what a GPU run takes) and the
    model's dtype under the embedded engine."""
    if config.rollout.dtype != "auto":
        return config.rollout.dtype
    return config.model.dtype if config.rollout.engine == "embedded" else "bf16"


def sequence_length(config: TrainConfig) -> int:
    return config.data.max_prompt_length + config.data.max_response_length


def micro_batch_rows(micro_batch: int, max_tokens: int, seq: int) -> int:
    """Rows of a micro-batch: `micro_batch`, or with a token budget the full-length rows it holds."""
    return max(1, max_tokens // seq) if max_tokens else micro_batch


@dataclass
class Phase:
    """One phase's peak on the rank where it is largest: the roles' resident state plus what the phase adds."""

    stage: int
    resident_bytes: float
    parts: dict[str, float]

    @property
    def total_bytes(self) -> float:
        return self.resident_bytes + sum(self.parts.values())


@dataclass
class MemoryPlan:
    model_type: str
    layout: Layout
    roles: dict[str, dict[str, float]]  # role -> {params, grads, optimizer} bytes on the largest stage's rank
    phases: dict[str, Phase]
    flops: dict[str, float]
    bytes_moved: dict[str, float]
    gpu_memory_gb: float | None
    rollout_weights_fit: bool  # vLLM's weights fit its share of the GPU (or the GPU's size is unknown)
    notes: list[str]

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda name: self.phases[name].total_bytes)

    @property
    def max_memory_allocated_gb(self) -> float:
        return self.phases[self.peak_phase].total_bytes / GIB

    @property
    def fits(self) -> bool | None:
        if self.gpu_memory_gb is None:
            return None
        return self.rollout_weights_fit and self.max_memory_allocated_gb <= self.gpu_memory_gb

    def to_json(self) -> dict:
        gb = lambda value: round(value / GIB, 3)  # noqa: E731
        return {
            "model_type": self.model_type,
            "layout": {**dataclasses.asdict(self.layout), "dp": self.layout.dp},
            "max_memory_allocated_gb": round(self.max_memory_allocated_gb, 3),
            "peak_phase": self.peak_phase,
            "gpu_memory_gb": self.gpu_memory_gb,
            "fits": self.fits,
            "roles": {role: {part: gb(value) for part, value in parts.items()} for role, parts in self.roles.items()},
            "phases": {name: {"gb": gb(phase.total_bytes), "stage": phase.stage, "resident_gb": gb(phase.resident_bytes),
                              **{f"{part}_gb": gb(value) for part, value in phase.parts.items()}}
                       for name, phase in self.phases.items()},
            "tflops": {name: round(value / 1e12, 3) for name, value in self.flops.items()},
            "bytes_moved_gb": {name: gb(value) for name, value in self.bytes_moved.items()},
            "notes": self.notes,
        }

    def format(self) -> str:
        lines = [f"{self.model_type}: {self.layout.describe()}",
                 f"predicted max_memory_allocated: {self.max_memory_allocated_gb:.2f} GiB per rank ({self.peak_phase})"
                 + ("" if self.fits is None else
                    f"; {'fits' if self.fits else 'does NOT fit'} {self.gpu_memory_gb:g} GiB")]
        for role, parts in self.roles.items():
            lines.append(f"  {role:<10} " + "  ".join(f"{part} {value / GIB:.2f}" for part, value in parts.items()))
        for name, phase in self.phases.items():
            added = "  ".join(f"{part} {value / GIB:.2f}" for part, value in phase.parts.items())
            lines.append(f"  {name:<18} {phase.total_bytes / GIB:8.2f} GiB (stage {phase.stage}; resident "
                         f"{phase.resident_bytes / GIB:.2f}; {added})")
        lines.append("  TFLOP per step: " + "  ".join(f"{k} {v / 1e12:.1f}" for k, v in self.flops.items()))
        lines.append("  GiB moved per rank and step: " + "  ".join(f"{k} {v / GIB:.2f}"
                                                                   for k, v in self.bytes_moved.items()))
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def plan_memory(model: Model, layout: Layout, roles: Roles, gpu_memory_gb: float | None = None,
                attention: str = FLASH) -> MemoryPlan:
    """The plan of `model`'s run at `layout`; ValueError (naming the size) for a layout the model cannot take."""
    config, hf = model.config, model.hf_config
    e, seq = model.act_bytes, sequence_length(config)
    local_seq = seq / layout.cp  # context parallelism: each rank's share of every sequence
    if layout.vpp > 1 and (layout.pp == 1 or hf.num_layers % (layout.pp * layout.vpp)):
        raise ValueError(f"vpp={layout.vpp}: the interleaved schedule needs pp > 1 and pp x vpp dividing the "
                         f"{hf.num_layers} layers (pp={layout.pp})")
    transition = model.transition(layout)
    stage_params = model.stage_parameters(layout)
    shape = model_layer_shape(hf, attention)
    layers = math.ceil(hf.num_layers / layout.pp)
    vocab = padded_vocab_size(hf.vocab_size, layout.tp)
    actor, critic = config.actor, config.critic
    teachers = [(model.teacher(folder), teacher_layout_beside(config, layout)) for folder in roles.teachers]
    teacher_params = sum(max(teacher.stage_parameters(at)) for teacher, at in teachers) * e

    def resident(stage: int, reference_pass: bool = False) -> dict[str, dict[str, float]]:
        """What each role holds on the device; the reference's weights only in its own pass with
        `actor.offload.params` (they wait on the host otherwise: `roles.reference`)."""
        params = stage_params[stage]
        held = {"actor": _trained(params, e, layout.distributed_optimizer, layout.dp, layout.cpu_offload)}
        if roles.critic:
            held["critic"] = _trained(params, e, critic.optim.use_distributed_optimizer, layout.dp,
                                      critic.optim.cpu_offload)
        if roles.reference and (reference_pass or not layout.offload.params):
            held["reference"] = {"params": params * e}
        if teachers:
            held["teacher"] = {"params": teacher_params}
        return held

    def resident_bytes(stage: int, reference_pass: bool = False) -> float:
        return sum(sum(parts.values()) for parts in resident(stage, reference_pass).values())

    def released_per_parameter(offload: OffloadConfig, distributed: bool, cpu_offload: bool,
                               engine_loaded: bool) -> float:
        """Bytes per parameter a trained role sends away in the rollout window under `offload` (the parameters
        only once the engine has loaded its copy)."""
        per_parameter = optimizer_bytes_per_parameter(e, GRAD_BYTES, distributed, layout.dp)
        sharded = layout.dp if distributed else 1
        released = GRAD_BYTES if offload.grads else 0
        if offload.optimizer and not cpu_offload:
            released += ADAM_MOMENTS * FP32_BYTES / sharded
        if offload.params and engine_loaded:
            main_params = 0 if cpu_offload or e == FP32_BYTES else FP32_BYTES / sharded
            released += per_parameter["params"] + main_params
        return released

    def awake_resident_bytes(stage: int, engine_loaded: bool) -> float:
        """What stays on the device in the rollout window: less what `actor.offload` and `critic.offload` send
        away."""
        released = released_per_parameter(layout.offload, layout.distributed_optimizer, layout.cpu_offload,
                                          engine_loaded)
        if roles.critic:
            released += released_per_parameter(critic.offload, critic.optim.use_distributed_optimizer,
                                               critic.optim.cpu_offload, engine_loaded)
        return resident_bytes(stage) - stage_params[stage] * released

    def update(stage: int, schedule, recompute: RecomputeConfig, micro: int, with_logits: bool) -> Phase:
        rows = micro_batch_rows(micro, schedule.max_tokens_per_micro_batch, seq)
        micro_batches = max(1, schedule.mini_batch_size // (layout.dp * rows))
        held = in_flight_micro_batches(stage, layout.pp, micro_batches, layout.vpp)
        sizes = (shape, layers // layout.vpp, local_seq, rows, layout.tp, layout.sequence_parallel, recompute, e)
        rebuilt = rebuilt_bytes(*sizes)
        parts = {"activations": held * layout.vpp * (stage_activation_bytes(*sizes) - rebuilt) + rebuilt,
                 "attention_buffer": attention_buffer_bytes(shape, local_seq, rows, layout.tp, e)}
        working = backward_working_bytes(shape, local_seq, rows, layout.tp, recompute.granularity == "selective", e)
        if with_logits and stage == layout.pp - 1:
            parts["logits"] = logits_bytes(seq, rows, vocab, layout.tp, e)
            working = max(working, parts["logits"])  # the logits' gradient, at the start of the backward
        parts["backward"] = working
        return Phase(stage, resident_bytes(stage), parts)

    def forward(stage: int, schedule, micro: int, with_logits: bool, reference_pass: bool = False) -> Phase:
        rows = micro_batch_rows(micro, schedule.max_tokens_per_micro_batch, seq)
        parts = {"activations": layer_activation_bytes(shape, local_seq, rows, layout.tp, layout.sequence_parallel,
                                                       False, e),  # one layer's, freed as the next runs
                 "attention_buffer": attention_buffer_bytes(shape, local_seq, rows, layout.tp, e)}
        if with_logits and stage == layout.pp - 1:
            parts["logits"] = logits_bytes(seq, rows, vocab, layout.tp, e)
        return Phase(stage, resident_bytes(stage, reference_pass), parts)

    def teacher_pass(stage: int) -> Phase:
        """The largest of the teachers' forwards (they run one after another): one layer's activations and the
        logits at the teacher's layout, beside everything resident."""
        rows = micro_batch_rows(layout.micro_batch, actor.max_tokens_per_micro_batch, seq)
        passes = [{"activations": layer_activation_bytes(model_layer_shape(teacher.hf_config, attention), seq, rows,
                                                         at.tp, at.sequence_parallel, False, e),
                   "logits": logits_bytes(seq, rows, padded_vocab_size(teacher.hf_config.vocab_size, at.tp), at.tp, e)}
                  for teacher, at in teachers]
        return Phase(stage, resident_bytes(stage), max(passes, key=lambda parts: sum(parts.values())))

    rollout_weights = max(rank.rollout_bytes for rank in transition.ranks)
    transfer = max(rank.transition_peak_bytes for rank in transition.ranks)

    def rollout(stage: int) -> Phase:
        if gpu_memory_gb is not None:  # vLLM takes its share of the GPU, weights and KV cache together
            engine = {"engine": config.rollout.gpu_memory_utilization * gpu_memory_gb * GIB}
        else:
            sequences = config.data.batch_size * config.rollout.n * layout.rollout_tp / layout.gpus
            kv = kv_cache_bytes(hf, DTYPES[model.rollout_dtype], math.ceil(sequences) * seq)
            engine = {"weights": rollout_weights, "kv_cache": kv / min(layout.rollout_tp, hf.num_kv_heads)}
        return Phase(stage, awake_resident_bytes(stage, engine_loaded=True), engine)

    candidates: dict[str, list[Phase]] = {name: [] for name in (
        "actor.update", "actor.log_prob", "reference.log_prob", "teacher.log_prob", "critic.update", "critic.values",
        "transition", "rollout")}
    for stage in range(layout.pp):
        candidates["actor.update"].append(update(stage, actor, layout.recompute, layout.micro_batch, True))
        candidates["actor.log_prob"].append(forward(stage, actor, layout.micro_batch, True))
        if roles.reference:
            candidates["reference.log_prob"].append(forward(stage, actor, layout.micro_batch, True,
                                                            reference_pass=True))
        if teachers:
            candidates["teacher.log_prob"].append(teacher_pass(stage))
        if roles.critic:
            candidates["critic.update"].append(update(stage, critic, critic.recompute, critic.micro_batch_size,
                                                      False))
            candidates["critic.values"].append(forward(stage, critic, critic.micro_batch_size, False))
        candidates["transition"].append(Phase(stage, awake_resident_bytes(stage, engine_loaded=False),
                                              {"weights": rollout_weights, "buffers": transfer}))
        candidates["rollout"].append(rollout(stage))
    phases = {name: max(found, key=lambda phase: phase.total_bytes) for name, found in candidates.items() if found}
    largest_stage = max(range(layout.pp), key=lambda stage: stage_params[stage])
    notes = model.notes()
    weights_fit = gpu_memory_gb is None or rollout_weights < config.rollout.gpu_memory_utilization * gpu_memory_gb * GIB
    if not weights_fit:
        notes.append(f"vLLM's weights ({rollout_weights / GIB:.1f} GiB) leave no KV cache in "
                     "rollout.gpu_memory_utilization's share of the GPU: raise it or parallel.rollout_tp")
    return MemoryPlan(hf.model_type, layout, resident(largest_stage), phases, step_flops(model, layout, roles),
                      step_bytes_moved(model, layout, roles, transition, stage_params[largest_stage]),
                      gpu_memory_gb, weights_fit, notes)


def _trained(params: int, act_bytes: int, distributed: bool, dp: int, cpu_offload: bool = False) -> dict[str, float]:
    """A trained role's bytes on the device; with `cpu_offload` (megatron's HybridDeviceOptimizer, all of it) the
    optimizer's part lives on the host."""
    per_parameter = optimizer_bytes_per_parameter(act_bytes, GRAD_BYTES, distributed, dp)
    if cpu_offload:
        per_parameter["optimizer"] = 0
    return {part: params * value for part, value in per_parameter.items()}


def forward_flops(model: Model, tokens: float) -> float:
    """F: one forward over `tokens` tokens of full-length sequences."""
    hf, seq = model.hf_config, sequence_length(model.config)
    dense = tokens * (2 * model.active_parameters + 2 * hf.hidden_size * hf.vocab_size)
    attention = tokens / seq * 4 * hf.num_layers * hf.head_dim * hf.num_heads * seq**2
    return dense + attention


def step_flops(model: Model, layout: Layout, roles: Roles) -> dict[str, float]:
    """FLOPs of one step over all ranks, by part."""
    config = model.config
    tokens = config.data.batch_size * config.rollout.n * sequence_length(config)
    forward = forward_flops(model, tokens)

    def training(schedule, recompute: RecomputeConfig) -> float:
        return schedule.ppo_epochs * forward * (4 if recompute.granularity == "full" else 3)

    flops = {"generation": forward, "actor.log_prob": forward, "actor.update": training(config.actor, layout.recompute)}
    if roles.reference:
        flops["reference.log_prob"] = forward
    for folder in roles.teachers:
        flops["teacher.log_prob"] = flops.get("teacher.log_prob", 0.0) + forward_flops(model.teacher(folder), tokens)
    if roles.critic:
        flops["critic.values"] = forward
        flops["critic.update"] = training(config.critic, config.critic.recompute)
    flops["total"] = sum(flops.values())
    return flops


def gradient_sync_bytes(params: int, act_bytes: int, distributed: bool, dp: int) -> float:
    """Bytes one rank sends per optimizer step to synchronise its gradients (ring collectives)."""
    share = (dp - 1) / dp
    if distributed:
        return share * params * (GRAD_BYTES + act_bytes)  # reduce-scatter the gradients, all-gather the params
    return 2 * share * params * GRAD_BYTES


def step_bytes_moved(model: Model, layout: Layout, roles: Roles, transition: Plan, params: int) -> dict[str, float]:
    config = model.config
    rows = config.data.batch_size * config.rollout.n

    def gradients(schedule, distributed: bool) -> float:
        steps = schedule.ppo_epochs * max(1, rows // schedule.mini_batch_size)
        return steps * gradient_sync_bytes(params, model.act_bytes, distributed, layout.dp)

    moved = {"transition_send": max(rank.send_bytes for rank in transition.ranks),
             "transition_recv": max(rank.recv_bytes for rank in transition.ranks),
             "actor.gradients": gradients(config.actor, layout.distributed_optimizer)}
    if roles.critic:
        moved["critic.gradients"] = gradients(config.critic, config.critic.optim.use_distributed_optimizer)
    return moved


def candidate_layouts(config: TrainConfig, gpus: int) -> list[Layout]:
    """The layouts `suggest_layouts` tries on `gpus` ranks, cheapest first: least recompute, then without the
    optimizer's CPU offload (the distributed optimizer's only, as the pre-flight check requires), then fewest
    model-parallel ranks (tp x pp; tp before pp), then the smallest rollout_tp (the config's where it divides tp,
    else tp), then without the distributed optimizer, then the largest micro-batch. Sizes are powers of two
    dividing `gpus`; ep and actor.offload stay the config's; cp (which needs transformer-engine) and vpp (a
    schedule, not a memory saving: it holds more in flight) are 1."""
    base = layout_of(config, gpus)
    sizes = [size for size in (2**k for k in range(int(math.log2(gpus)) + 1)) if gpus % size == 0]
    micro = []
    size = config.actor.micro_batch_size
    while size >= 1:
        micro.append(size)
        size //= 2
    recomputes = [RecomputeConfig("none"), RecomputeConfig("selective"), RecomputeConfig("full", "uniform", 1)]
    layouts = [dataclasses.replace(base, tp=tp, pp=pp, sequence_parallel=tp > 1, recompute=recompute,
                                   distributed_optimizer=distributed, micro_batch=rows, rollout_tp=rollout_tp,
                                   cp=1, vpp=1, cpu_offload=cpu_offload)
               for recompute in recomputes for tp in sizes for pp in sizes if gpus % (tp * pp) == 0
               for rollout_tp in sorted({base.rollout_tp if tp % base.rollout_tp == 0 else tp, tp})
               for distributed in (False, True) for cpu_offload in (False, True)[:1 + distributed]
               for rows in micro]
    return sorted(layouts, key=lambda lay: (RECOMPUTE_COST[lay.recompute.granularity], lay.cpu_offload,
                                            lay.tp * lay.pp, lay.pp, lay.rollout_tp, lay.distributed_optimizer,
                                            -lay.micro_batch))


def suggest_layouts(model: Model, roles: Roles, gpus: int, gpu_memory_gb: float, limit: int = 10,
                    attention: str = FLASH) -> list[MemoryPlan]:
    """Up to `limit` plans that fit `gpu_memory_gb`, cheapest first (`candidate_layouts`' order)."""
    fitting = []
    for layout in candidate_layouts(model.config, gpus):
        try:
            found = plan_memory(model, layout, roles, gpu_memory_gb, attention)
        except ValueError:  # a size the model cannot be split by, or rollout_tp not dividing tp
            continue
        if found.fits:
            fitting.append(found)
            if len(fitting) == limit:
                break
    return fitting
