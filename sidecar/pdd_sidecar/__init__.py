"""pdd data-plane sidecar: the DeepSeek-V2 (MLA + MoE) model, paged latent KV cache with
decode context parallelism, and (elsewhere in this package) NIXL transfer and servers."""
