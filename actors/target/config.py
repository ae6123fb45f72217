"""Target model configuration, read from a Hugging Face `config.json`: the Qwen3-MoE and
Qwen2-MoE families, Mixtral, OLMoE, GLM-4-MoE, Hunyuan-MoE and DeepSeek-V3 (one decoder: RMSNorm,
RoPE, GQA or latent attention, a top-k router, SwiGLU experts; the families differ in q/k norms and
where they sit, biases, shared experts, routing (softmax, or grouped sigmoid with a correction
bias), partial RoPE, and DeepSeek-V3's multi-head latent attention)."""

from __future__ import annotations

import json
import pathlib
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property

from actors.target.rope import Rotary, yarn_mscale
from dcut_core.hardware import ModelShape

SUPPORTED_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe", "hunyuan_v1_moe", "deepseek_v3",
                   "dcut_moe")
WHOLE_WIDTH_EXPERTS = ("mixtral", "olmoe", "hunyuan_v1_moe")
ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "mixtral": "MixtralForCausalLM", "olmoe": "OlmoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
                 "hunyuan_v1_moe": "HunYuanMoEV1ForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM"}


@dataclass(frozen=True)
class MoEConfig:
    """Decoder-only MoE transformer: RMSNorm, RoPE, GQA, top-k softmax router, SwiGLU experts."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int  # width of dense MLP layers (layers without experts)
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0  # > 0: a shared expert every token passes through
    shared_expert_gated: bool = True  # its output scaled by a sigmoid gate (Qwen2-MoE), or not (GLM-4-MoE)
    router: str = "softmax"  # softmax top-k; "sigmoid_grouped": sigmoid scores, correction bias, group-limited
    n_group: int = 1  # sigmoid_grouped: expert groups, of which the best topk_group are searched
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # sigmoid_grouped: routed experts' weights scaled by this
    partial_rotary_factor: float = 1.0  # share of each head's dims that RoPE rotates (GLM-4-MoE: 0.5)
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qk_norm: bool = True  # Qwen3 normalises q and k per head; Qwen2 and Mixtral do not
    qk_norm_full: bool = False  # OLMoE: q and k normalised over the whole projection, before the heads split
    qk_norm_after_rope: bool = False  # Hunyuan-MoE: the per-head q/k norm comes after RoPE
    attention_bias: bool = False
    # Multi-head latent attention (DeepSeek-V3), on when kv_lora_rank > 0; head_dim is then the
    # RoPE part of each query/key head (qk_rope_head_dim) and the cache holds the latent
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # 0: queries from one projection, else through a rank-q bottleneck
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # RoPE dims laid out in pairs (DeepSeek-V3's weights)
    rope_yarn: tuple = ()  # YaRN parameters (key, value) as the config gives them; () = plain RoPE
    model_type: str = "qwen3_moe"
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError("num_experts_per_tok cannot exceed num_experts")

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates (the first ones; the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def latent(self) -> bool:
        """Multi-head latent attention (the cache holds kv_lora_rank + head_dim per token and layer)."""
        return self.kv_lora_rank > 0

    @cached_property
    def rotary(self) -> Rotary:
        return Rotary(self.rotary_dim, self.rope_theta, self.rope_yarn)

    @property
    def attention_scale(self) -> float:
        """MLA's softmax scale: 1/sqrt of the query-key width (the no-RoPE part counts too), times
        YaRN's mscale(mscale_all_dim)² where the config scales RoPE (DeepSeek-V3)."""
        scale = (self.qk_nope_head_dim + self.head_dim) ** -0.5
        yarn = dict(self.rope_yarn)
        if yarn.get("mscale_all_dim"):
            scale *= yarn_mscale(float(yarn["factor"]), float(yarn["mscale_all_dim"])) ** 2
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    @classmethod
    def from_dict(cls, d: dict) -> MoEConfig:
        model_type = d.get("model_type", "qwen3_moe")
        if model_type not in SUPPORTED_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_TYPES)}")
        scaling = d.get("rope_scaling") or d.get("rope_parameters")
        rope_type = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else "default"
        if rope_type not in ("default", "yarn"):
            raise ValueError(f"rope scaling {scaling!r} is not supported (default and yarn are)")
        yarn = tuple(sorted((k, v) for k, v in scaling.items() if k not in (
            "rope_type", "type", "rope_theta", "partial_rotary_factor"))) if rope_type == "yarn" else ()
        if d.get("use_sliding_window") or (model_type == "mixtral" and d.get("sliding_window") is not None):
            raise ValueError("sliding-window attention is not supported")
        if d.get("clip_qkv") is not None:
            raise ValueError("clip_qkv is not supported")
        hunyuan = model_type == "hunyuan_v1_moe"
        if hunyuan and (not isinstance(d.get("num_experts"), int) or not isinstance(d.get("moe_topk", 1), int)
                        or d.get("use_cla")):
            raise ValueError("Hunyuan-MoE with per-layer expert counts or cross-layer attention is not supported")
        glm = model_type == "glm4_moe"  # GLM-4-MoE's own keys, beside ours (a config we wrote has ours)
        deepseek = model_type == "deepseek_v3"
        if deepseek and d.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ValueError(f"DeepSeek routing {d.get('topk_method')!r} is not supported (only noaux_tc)")
        partial = d.get("partial_rotary_factor")
        if partial is None and isinstance(scaling, dict):
            partial = scaling.get("partial_rotary_factor")
        shared = d.get("shared_expert_intermediate_size")
        if shared is None and hunyuan:  # a shared MLP as wide as an expert
            shared = int(d.get("intermediate_size", 0))
        if shared is None:
            shared = int(d.get("moe_intermediate_size", 0)) * int(d.get("n_shared_experts", 0))
        theta = d.get("rope_theta")
        if theta is None and isinstance(scaling, dict):
            theta = scaling.get("rope_theta")
        heads = int(d["num_attention_heads"])
        eos = d.get("eos_token_id")
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads", heads)),
            head_dim=int(d["qk_rope_head_dim"]) if deepseek else int(d.get("head_dim") or d["hidden_size"] // heads),
            intermediate_size=int(d.get("intermediate_size", 0)),
            # Mixtral, OLMoE and Hunyuan-MoE have experts in every layer, `intermediate_size` wide
            moe_intermediate_size=int(d.get("intermediate_size", 0) if model_type in WHOLE_WIDTH_EXPERTS
                                      else d.get("moe_intermediate_size", 0)),
            num_experts=int(d.get("num_experts", d.get("num_local_experts", d.get("n_routed_experts", 0)))),
            num_experts_per_tok=int(d.get("num_experts_per_tok", d.get("moe_topk", 0))),
            norm_topk_prob=bool(d.get("norm_topk_prob", model_type not in ("qwen2_moe", "olmoe"))),
            shared_expert_intermediate_size=int(shared),
            shared_expert_gated=bool(d.get("shared_expert_gated", not (glm or hunyuan or deepseek))),
            router=d.get("router", "sigmoid_grouped" if glm or deepseek else "softmax"),
            n_group=int(d.get("n_group") or 1),
            topk_group=int(d.get("topk_group") or 1),
            routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0),
            partial_rotary_factor=float(partial or 1.0),
            decoder_sparse_step=int(d.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(d["mlp_only_layers"]) if "mlp_only_layers" in d
            else tuple(range(int(d.get("first_k_dense_replace", 0)))),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta if theta is not None else 1e6),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qk_norm=bool(d.get("use_qk_norm", False)) if glm else bool(d.get("qk_norm", model_type in (
                "qwen3_moe", "dcut_moe", "hunyuan_v1_moe"))),
            qk_norm_after_rope=bool(d.get("qk_norm_after_rope", hunyuan)),
            qk_norm_full=model_type == "olmoe",
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2_moe")),
            kv_lora_rank=int(d.get("kv_lora_rank") or 0) if deepseek else 0,
            q_lora_rank=int(d.get("q_lora_rank") or 0) if deepseek else 0,
            qk_nope_head_dim=int(d.get("qk_nope_head_dim") or 0) if deepseek else 0,
            v_head_dim=int(d.get("v_head_dim") or 0) if deepseek else 0,
            rope_interleave=bool(d.get("rope_interleave", True)) if deepseek else False,
            rope_yarn=yarn,
            model_type=model_type,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
            extra={k: v for k, v in d.items() if k not in known},
        )

    @classmethod
    def load(cls, model_dir: str | pathlib.Path) -> MoEConfig:
        return cls.from_dict(json.loads((pathlib.Path(model_dir) / "config.json").read_text()))

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("extra")
        d["mlp_only_layers"] = list(self.mlp_only_layers)
        d["architectures"] = [ARCHITECTURES.get(self.model_type, self.model_type)]
        d.pop("rope_yarn")
        d["rope_parameters"] = {"rope_type": "yarn" if self.rope_yarn else "default", "rope_theta": self.rope_theta,
                                **dict(self.rope_yarn)}
        d["hidden_act"] = "silu"
        if self.latent:
            d["qk_rope_head_dim"] = self.head_dim
        return d

    def shape(self, name: str = "target", param_bytes: int = 4) -> ModelShape:
        """What the cost model needs to know about this model."""
        dense_layers = self.num_hidden_layers - self.moe_layers
        return ModelShape(
            name, self.num_hidden_layers, self.hidden_size, self.num_attention_heads,
            self.num_key_value_heads, self.head_dim, self.vocab_size,
            self.intermediate_size if dense_layers else 0,
            experts=self.num_experts, top_k=self.num_experts_per_tok,
            expert_intermediate=self.moe_intermediate_size,
            shared_intermediate=self.shared_expert_intermediate_size,
            moe_layers=self.moe_layers, param_bytes=param_bytes, act_bytes=param_bytes,
            kv_lora_rank=self.kv_lora_rank, q_lora_rank=self.q_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
            v_head_dim=self.v_head_dim,
        )


# Settings that change a model's numbers but not the cost of a step: a cost-model view of a
# config.json drops them instead of refusing the folder (serving still refuses what it cannot run).
NUMERICS_ONLY = ("rope_scaling", "rope_parameters", "clip_qkv", "topk_method", "quantization_config")


def model_shape(path: str | pathlib.Path, name: str | None = None, act_bytes: int = 2) -> ModelShape:
    """The cost model's and simulator's view of a checkpoint from its config.json alone (the file
    or its folder): a preset for a model this machine cannot hold. FP8 block-scaled weights
    (`quantization_config.quant_method: fp8`) count one byte a parameter, others two."""
    path = pathlib.Path(path)
    file = path / "config.json" if path.is_dir() else path
    d = json.loads(file.read_text())
    fp8 = (d.get("quantization_config") or {}).get("quant_method") == "fp8"
    cfg = MoEConfig.from_dict({k: v for k, v in d.items() if k not in NUMERICS_ONLY})
    shape = cfg.shape(name or file.parent.name if file.name == "config.json" else file.stem, 1 if fp8 else 2)
    return replace(shape, act_bytes=act_bytes)
