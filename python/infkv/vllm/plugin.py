"""vLLM's entry point into infkv (`vllm.general_plugins`, loaded in every vLLM process): vLLM's CPU
attention backend is replaced by infkv's subclass, which only adds a copy of the window queries
when infkv's model runner asks for them (infkv.vllm.engine)."""


def register() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, "infkv.vllm.engine.InfkvCPUAttentionBackend")
