"""Kernels: the passes over logits. They know only tensors, shapes and scalars.

Every backend module exposes the same two functions over flattened rows
(``N`` rows of a contiguous ``(N, V)`` logits tensor, inputs already validated by ``ops/``):

``token_logprobs_fwd(logits, targets, temperature, need_entropy) -> (logp, entropy, lse)``
    logits ``(N, V)`` fp16/bf16/fp32 (fp64 where the backend supports it), targets ``(N,)``
    int64 in ``[0, V)``. Returns fp32 tensors of shape ``(N,)`` (fp64 for fp64 logits):
    ``logp = x_y - lse``, the entropy ``H = lse - sum_v p_v x_v`` (an empty tensor when
    ``need_entropy`` is False) and ``lse = logsumexp(x)``, with ``x = logits / temperature``.

``token_logprobs_bwd(logits, targets, lse, entropy, grad_logp, grad_entropy, temperature, out=None) -> grad_logits``
    ``grad_logits[n, v] = (1/τ)·[g·(1[v=y] − p_v) − h·p_v·(log p_v + H)]`` with ``g = grad_logp``
    and ``h = grad_entropy`` (``None`` means 0; ``entropy`` may then be empty), in the dtype of
    ``logits``, shape ``(N, V)``. ``out``: an ``(N, V)`` tensor with unit stride over V to
    write into instead of a new one; it may be ``logits`` itself (every element is read before
    it is overwritten), which is how ``fused_policy_loss(inplace=True)`` saves an N×V buffer.
"""
