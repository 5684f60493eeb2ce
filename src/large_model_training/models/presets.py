"""Model presets: small ones that train on a laptop CPU, and the published shapes of real models for planning.

Each preset is a dict of `ModelConfig` fields. Sources of the published shapes:
  llama-1b, llama3-8b/70b/405b: Meta, "The Llama 3 Herd of Models" (2024), Table 3, and the released configs.
  gpt3-175b: Brown et al., "Language Models are Few-Shot Learners" (2020), Table 2.1.
  megatron-*: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
    Megatron-LM" (SC'21), Table 1 (GPT shapes with vocab 51,200 and sequence 2,048).
  llama-100b: not a published model; a Llama-3-style shape of 100.4B parameters, for the seed's "千亿参数"
    (hundred-billion) scale between llama3-70b and gpt3-175b.
  mixtral-8x7b: Mistral AI's released config (Jiang et al., "Mixtral of Experts", 2024).
  qwen3-30b-a3b: Qwen's released config (Qwen3 technical report, 2025).
  deepseek-v3: DeepSeek-AI, "DeepSeek-V3 Technical Report" (2024) and its config; see the preset's comment.
"""

_BYTE = dict(vocab_size=256, mlp="swiglu", norm="rmsnorm", position="rope")
_LLAMA3 = dict(
    vocab_size=128256,
    mlp="swiglu",
    norm="rmsnorm",
    position="rope",
    rope_theta=500000.0,
    max_seq_len=8192,
    tie_embeddings=False,
)
_GPT = dict(mlp="gelu", norm="layernorm", position="learned", tie_embeddings=True, max_seq_len=2048)

PRESETS: dict[str, dict] = {
    # Trains visibly in minutes on 2 CPU cores: ~0.6M parameters, byte-level.
    "tiny": dict(_BYTE, hidden_size=128, n_layers=4, n_heads=4, n_kv_heads=0, ffn_hidden_size=384, max_seq_len=256),
    # About 30M parameters, byte-level.
    "small": dict(_BYTE, hidden_size=512, n_layers=10, n_heads=8, n_kv_heads=0, ffn_hidden_size=1280, max_seq_len=1024),
    # Llama 3.2 1B shape (tied embeddings), used for accelerator throughput benchmarks.
    "llama-1b": dict(
        _LLAMA3, hidden_size=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden_size=8192, tie_embeddings=True
    ),
    "llama3-8b": dict(_LLAMA3, hidden_size=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden_size=14336),
    "llama3-70b": dict(_LLAMA3, hidden_size=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden_size=28672),
    "llama-100b": dict(_LLAMA3, hidden_size=10240, n_layers=88, n_heads=80, n_kv_heads=8, ffn_hidden_size=28672),
    "llama3-405b": dict(_LLAMA3, hidden_size=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_hidden_size=53248),
    "gpt3-175b": dict(
        _GPT, vocab_size=50257, hidden_size=12288, n_layers=96, n_heads=96, n_kv_heads=0, ffn_hidden_size=49152
    ),
    "megatron-18b": dict(
        _GPT, vocab_size=51200, hidden_size=6144, n_layers=40, n_heads=48, n_kv_heads=0, ffn_hidden_size=24576
    ),
    "megatron-145b": dict(
        _GPT, vocab_size=51200, hidden_size=12288, n_layers=80, n_heads=96, n_kv_heads=0, ffn_hidden_size=49152
    ),
    "megatron-530b": dict(
        _GPT, vocab_size=51200, hidden_size=20480, n_layers=105, n_heads=128, n_kv_heads=0, ffn_hidden_size=81920
    ),
    "megatron-1t": dict(
        _GPT, vocab_size=51200, hidden_size=25600, n_layers=128, n_heads=160, n_kv_heads=0, ffn_hidden_size=102400
    ),
    # tiny's shape with 8 experts of f=128, top-2, gates renormalised over the two (as Mixtral and Qwen3-MoE;
    # without it the MoE starts at a quarter of a dense MLP's output): trains on this CPU in a minute.
    "tiny-moe": dict(
        _BYTE,
        hidden_size=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=0,
        ffn_hidden_size=384,
        max_seq_len=256,
        moe_experts=8,
        moe_top_k=2,
        moe_ffn_hidden_size=128,
        moe_norm_topk=True,
    ),
    # DeepSeek-V3's architecture at byte level, trainable on the embedded corpus: MLA (query latent 64, key/value
    # latent 32, heads 32 + 16 rotary wide), one dense block, then 8 routed experts (top-2 of the best 2 of 4
    # groups, sigmoid, bias balancing, the sequence-wise loss) and a shared one. Exports to DeepseekV3ForCausalLM.
    "tiny-mla-moe": dict(
        _BYTE,
        hidden_size=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=0,
        ffn_hidden_size=384,
        max_seq_len=256,
        norm_eps=1e-6,
        attention="mla",
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        moe_experts=8,
        moe_top_k=2,
        moe_ffn_hidden_size=128,
        moe_shared_experts=1,
        moe_first_dense=1,
        moe_router="sigmoid",
        moe_norm_topk=True,
        moe_groups=4,
        moe_topk_groups=2,
        moe_aux_loss_coef=0.001,
        moe_aux_loss_scope="sequence",
        moe_bias_update_rate=0.001,
    ),
    # 46.7B total, 12.9B active; softmax router, top-2 (gates renormalised over the two), no shared experts.
    "mixtral-8x7b": dict(
        _BYTE,
        vocab_size=32000,
        hidden_size=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden_size=14336,
        max_seq_len=32768,
        rope_theta=1000000.0,
        moe_experts=8,
        moe_top_k=2,
        moe_ffn_hidden_size=14336,
        moe_norm_topk=True,
    ),
    # 30.5B total, 3.3B active; 128 experts, top-8; 32 heads of 128 (attention 4096 wide at width 2048).
    "qwen3-30b-a3b": dict(
        _BYTE,
        vocab_size=151936,
        hidden_size=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        attention_head_dim=128,
        ffn_hidden_size=6144,
        max_seq_len=40960,
        rope_theta=1000000.0,
        moe_experts=128,
        moe_top_k=8,
        moe_ffn_hidden_size=768,
        moe_norm_topk=True,
        qk_norm=True,
    ),
    # 671B total, 37B active (671.03B and 37.55B here): multi-head latent attention (128 heads, query latent
    # 1536, key/value latent 512, heads 128 + 64 rotary wide, values 128), 3 dense blocks, then 256 routed
    # experts (top-8 from 4 of 8 groups, sigmoid, bias balancing, routed scale 2.5) and one shared. Its
    # multi-token prediction module (14B more in the released checkpoint) is not modelled yet.
    "deepseek-v3": dict(
        _BYTE,
        vocab_size=129280,
        hidden_size=7168,
        n_layers=61,
        n_heads=128,
        n_kv_heads=0,
        attention="mla",
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        ffn_hidden_size=18432,
        max_seq_len=4096,
        moe_experts=256,
        moe_top_k=8,
        moe_ffn_hidden_size=2048,
        moe_shared_experts=1,
        moe_first_dense=3,
        moe_router="sigmoid",
        moe_aux_loss_coef=0.0001,
        moe_aux_loss_scope="sequence",
        moe_bias_update_rate=0.001,
        moe_groups=8,
        moe_topk_groups=4,
        moe_routed_scale=2.5,
    ),
}
