"""Which op calls were made in an autograd graph, and whether each one's backward ran: wraps the named ops of a
module (monkeypatch) and marks a call when the engine reaches its outputs' node."""
import torch


def count_op_calls(monkeypatch, module, names) -> list:
    calls = []

    def counted(name, op):
        def call(*args, **kwargs):
            out = op(*args, **kwargs)
            parts = out if isinstance(out, tuple) else tuple(getattr(out, f) for f in ("loss", "logp", "entropy")
                                                             if hasattr(out, f)) or (out,)
            nodes = {t.grad_fn for t in parts if isinstance(t, torch.Tensor) and t.grad_fn is not None}
            seen = {"op": name, "graph": bool(nodes), "backward": False}
            for node in nodes:
                node.register_prehook(lambda grads, seen=seen: seen.update(backward=True))
            calls.append(seen)
            return out
        return call

    for name in names:
        monkeypatch.setattr(module, name, counted(name, getattr(module, name)))
    return calls


def forward_only_in_a_graph(calls) -> list:
    """The calls that built a graph no backward went through: what pays the two-pass path's N × V gradient."""
    return [c for c in calls if c["graph"] and not c["backward"]]
