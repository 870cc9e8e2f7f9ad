"""The configuration classes of remask's own model families, in one light module.

Importing this module imports `transformers.PreTrainedConfig` (and Qwen2's configuration) but
not the model classes (`transformers.PreTrainedModel` pulls in `transformers.modeling_utils`, its
quantizers and torch's compiler: seconds), so `remask.models` registers these classes with
`AutoConfig` cheaply (`register_configs`). The model classes are registered with the Auto model
classes by their family module (`registry.register_family` at its end), which each config imports
when it is built (`__post_init__` → `registry.load_family_module`): a config always exists before
`AutoModel.from_pretrained` / `from_config` looks its model class up. The family modules re-export
their config (`from remask.models.llada import LLaDAConfig` keeps working).
"""
from __future__ import annotations

from typing import Any

from transformers import PreTrainedConfig
from transformers.models.qwen2.configuration_qwen2 import Qwen2Config

from .registry import accept_attn_implementation, load_family_module


def _prepare(config: PreTrainedConfig, kwargs: dict[str, Any]) -> None:
    """What every family config does first in `__post_init__`: make sure its family module (the
    model classes, registered with the Auto classes) is imported, and drop an attention
    implementation remask does not offer."""
    load_family_module(type(config).model_type)
    accept_attn_implementation(type(config).__name__, kwargs)


class LLaDAConfig(PreTrainedConfig):
    """Configuration with the keys of LLaDA's official `config.json` (defaults: LLaDA-8B)."""

    model_type = "llada"
    keys_to_ignore_at_inference = ["past_key_values"]

    d_model: int = 4096
    n_heads: int = 32
    n_kv_heads: int | None = None
    n_layers: int = 32
    mlp_ratio: int = 4
    mlp_hidden_size: int | None = None
    activation_type: str = "silu"
    block_type: str = "llama"
    block_group_size: int = 1
    alibi: bool = False
    rope: bool = True
    rope_full_precision: bool = True
    rope_theta: float = 500000.0
    layer_norm_type: str = "rms"
    layer_norm_with_affine: bool = True
    rms_norm_eps: float = 1e-5
    include_bias: bool = False
    include_qkv_bias: bool = False
    weight_tying: bool = False
    scale_logits: bool = False
    input_emb_norm: bool = False
    vocab_size: int = 126464
    embedding_size: int | None = 126464
    max_sequence_length: int = 4096
    init_std: float = 0.02
    use_cache: bool = False
    mask_token_id: int | None = 126336
    eos_token_id: int | None = 126081
    pad_token_id: int | None = 126081
    bos_token_id: int | None = None

    def __post_init__(self, **kwargs):
        _prepare(self, kwargs)
        super().__post_init__(**kwargs)

    @property
    def effective_n_kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def mlp_hidden(self) -> int:
        return self.mlp_hidden_size if self.mlp_hidden_size is not None else self.mlp_ratio * self.d_model

    @property
    def padded_vocab_size(self) -> int:
        return self.embedding_size or self.vocab_size

    def validate_architecture(self) -> None:
        """Reject variants of the OLMo-derived config that LLaDA checkpoints never use."""
        checks = {
            "block_type": (self.block_type, ("llama",)),
            "activation_type": (self.activation_type, ("silu",)),
            "layer_norm_type": (self.layer_norm_type, ("rms",)),
            "alibi": (self.alibi, (False,)),
            "rope": (self.rope, (True,)),
            "block_group_size": (self.block_group_size, (1,)),
        }
        for name, (value, allowed) in checks.items():
            if value not in allowed:
                raise ValueError(f"LLaDAConfig.{name}={value!r} is not supported; allowed: {list(allowed)}")
        if self.d_model % self.n_heads or self.n_heads % self.effective_n_kv_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}) and n_heads by n_kv_heads "
                f"({self.effective_n_kv_heads})"
            )


class DreamConfig(PreTrainedConfig):
    """Configuration with the keys of Dream's official `config.json` (defaults: Dream-v0-7B)."""

    model_type = "Dream"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 152064
    hidden_size: int = 3584
    intermediate_size: int = 18944
    num_hidden_layers: int = 28
    num_attention_heads: int = 28
    num_key_value_heads: int | None = 4
    hidden_act: str = "silu"
    max_position_embeddings: int = 131072
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = False
    tie_word_embeddings: bool = False
    rope_theta: float = 1000000.0
    rope_scaling: dict | None = None
    use_sliding_window: bool = False
    sliding_window: int | None = None
    max_window_layers: int = 28
    attention_dropout: float = 0.0
    mask_token_id: int | None = 151666
    pad_token_id: int | None = 151643
    bos_token_id: int | None = 151643
    eos_token_id: int | None = 151643

    def __post_init__(self, **kwargs):
        _prepare(self, kwargs)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        super().__post_init__(**kwargs)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def validate_architecture(self) -> None:
        if self.hidden_act != "silu":
            raise ValueError(f"DreamConfig.hidden_act={self.hidden_act!r} is not supported; allowed: ['silu']")
        if self.rope_scaling not in (None, {}) and self.rope_scaling.get("rope_type", "default") != "default":
            raise ValueError(f"DreamConfig.rope_scaling={self.rope_scaling!r} is not supported; allowed: [None]")
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads}) and that by num_key_value_heads ({self.num_key_value_heads})"
            )


class SDARConfig(PreTrainedConfig):
    """Configuration with the keys of SDAR's official `config.json` (defaults: its configuration
    file's; the released checkpoints set their own sizes, `block_size` and `mask_token_id`)."""

    model_type = "sdar"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 32
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    attention_bias: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    max_window_layers: int = 28
    attention_dropout: float = 0.0
    block_size: int = 4
    mask_token_id: int | None = 151669
    pad_token_id: int | None = None
    bos_token_id: int | None = 151643
    eos_token_id: int | list[int] | None = 151643

    def __post_init__(self, **kwargs):
        _prepare(self, kwargs)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        super().__post_init__(**kwargs)

    def validate_architecture(self) -> None:
        if self.hidden_act != "silu":
            raise ValueError(f"SDARConfig.hidden_act={self.hidden_act!r} is not supported; allowed: ['silu']")
        if self.rope_scaling not in (None, {}) and self.rope_scaling.get("rope_type", "default") != "default":
            raise ValueError(f"SDARConfig.rope_scaling={self.rope_scaling!r} is not supported; allowed: [None]")
        if self.use_sliding_window:
            raise ValueError("SDARConfig.use_sliding_window=True is not supported (the official inference path "
                             "ignores it too)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")


class SDARMoeConfig(SDARConfig):
    """SDAR-MoE (`model_type: "sdar_moe"`, `SDARMoeForCausalLM`): SDAR on a Qwen3-MoE backbone. The
    MoE keys are Qwen3-MoE's: `num_experts`, `num_experts_per_tok`, `moe_intermediate_size`,
    `decoder_sparse_step` (every n-th layer is sparse), `mlp_only_layers` (dense anyway),
    `norm_topk_prob`; `intermediate_size` sizes the dense layers."""

    model_type = "sdar_moe"

    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    decoder_sparse_step: int = 1
    mlp_only_layers: list | None = None
    norm_topk_prob: bool = True
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001

    def validate_architecture(self) -> None:
        super().validate_architecture()
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"SDARMoeConfig.num_experts_per_tok={self.num_experts_per_tok} must be in "
                             f"[1, num_experts={self.num_experts}]")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"SDARMoeConfig.decoder_sparse_step={self.decoder_sparse_step} must be ≥ 1")

    def is_sparse(self, layer_idx: int) -> bool:
        return (layer_idx not in (self.mlp_only_layers or []) and self.num_experts > 0
                and (layer_idx + 1) % self.decoder_sparse_step == 0)


class LLaDA2MoeConfig(PreTrainedConfig):
    """Configuration with the keys of the official LLaDA2 `config.json`; defaults are LLaDA2.0-mini's
    values (the official configuration class's own defaults describe no released model)."""

    model_type = "llada2_moe"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 157184
    hidden_size: int = 2048
    intermediate_size: int | None = 5120
    num_hidden_layers: int = 20
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 4
    head_dim: int | None = 128
    hidden_act: str = "silu"
    use_qkv_bias: bool = False
    use_bias: bool = False
    use_qk_norm: bool = True
    rms_norm_eps: float = 1e-6
    norm_head: bool = False
    tie_word_embeddings: bool = False
    embedding_dropout: float = 0.0
    attention_dropout: float = 0.0
    output_dropout: float = 0.0
    initializer_range: float = 0.02
    max_position_embeddings: int = 16384
    rope_theta: float = 600000.0
    rope_scaling: dict | None = None
    partial_rotary_factor: float = 0.5
    rotary_dim: int | None = 64
    use_cache: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    max_window_layers: int = 28
    num_experts: int | None = 256
    num_shared_experts: int | None = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    moe_intermediate_size: int | None = 512
    first_k_dense_replace: int = 1
    norm_topk_prob: bool = True
    score_function: str = "sigmoid"
    router_dtype: str = "fp32"
    moe_router_enable_expert_bias: bool = True
    output_router_logits: bool = False
    pad_token_id: int | None = 156892
    eos_token_id: int | list[int] | None = None
    mask_token_id: int | None = None

    def __post_init__(self, **kwargs):
        _prepare(self, kwargs)
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        super().__post_init__(**kwargs)

    def validate_architecture(self) -> None:
        """Refuse settings the official forward would compute differently from this one."""
        def refuse(name: str, allowed: str) -> None:
            raise ValueError(f"LLaDA2MoeConfig.{name}={getattr(self, name)!r} is not supported; allowed: {allowed}")

        if self.hidden_act != "silu":
            refuse("hidden_act", "['silu']")
        if self.rope_scaling not in (None, {}) and self.rope_scaling.get("rope_type", "default") != "default":
            refuse("rope_scaling", "[None] (default RoPE)")
        if self.score_function != "sigmoid":
            refuse("score_function", "['sigmoid'] (the official router is sigmoid-only)")
        if not self.num_key_value_heads or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.num_experts is not None:
            if self.num_experts % self.n_group:
                raise ValueError(f"num_experts ({self.num_experts}) must be a multiple of n_group ({self.n_group})")
            if not 1 <= self.topk_group <= self.n_group:
                refuse("topk_group", f"an int in [1, n_group={self.n_group}]")
            if self.num_experts // self.n_group < 2:
                raise ValueError("each expert group needs at least 2 experts (groups are ranked by their top-2 sum)")
            if not 1 <= self.num_experts_per_tok <= self.topk_group * (self.num_experts // self.n_group):
                refuse("num_experts_per_tok", "an int ≥ 1 no larger than the experts of the chosen groups")

    @property
    def rope_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


class FastDLLMV2Config(Qwen2Config):
    """Configuration with the keys of Fast-dLLM v2's official `config.json`: Qwen2's, plus
    `bd_size` (the block size it was trained with) and `conplemenrary_mask` (the training-time
    complementary masking flag, spelled as released; inference ignores it). Defaults: the official
    configuration file's (the released checkpoints set their own sizes)."""

    model_type = "Fast_dLLM_Qwen"

    bd_size: int = 32
    conplemenrary_mask: bool = False

    def __post_init__(self, **kwargs):
        _prepare(self, kwargs)
        super().__post_init__(**kwargs)

    def validate_architecture(self) -> None:
        if self.hidden_act != "silu":
            raise ValueError(f"FastDLLMV2Config.hidden_act={self.hidden_act!r} is not supported; allowed: ['silu']")
        if self.use_sliding_window:
            raise ValueError("FastDLLMV2Config.use_sliding_window=True is not supported (the released model has none)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if not isinstance(self.bd_size, int) or self.bd_size < 1:
            raise ValueError(f"FastDLLMV2Config.bd_size must be an int >= 1, got {self.bd_size!r}")

CONFIG_CLASSES: tuple[type[PreTrainedConfig], ...] = (
    LLaDAConfig, DreamConfig, SDARConfig, SDARMoeConfig, LLaDA2MoeConfig, FastDLLMV2Config)


def register_configs() -> None:
    """Register every config class with transformers' `AutoConfig` (cheap: no model class is
    imported; each family module registers its model classes when a config of it is built)."""
    from transformers.models.auto.configuration_auto import AutoConfig

    for config_class in CONFIG_CLASSES:
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
