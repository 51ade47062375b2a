"""Trains a small GPT-style language model on the CPU with its AdamW state on disk
(tensormem.torch.OffloadedAdamW), next to the same model trained with torch.optim.AdamW in
memory, and prints the loss of both and the I/O statistics at every step.

    PYTHONPATH=build/python /usr/bin/python3 examples/python/train_offloaded.py \
        [--steps 50] [--swap-dir DIR ...] [--pinned-budget-mib 8] [--group-kib 256]

The text is a fixed pseudo-random sequence of tokens with structure to learn (each token is
followed by a token determined by it, with noise), so the loss falls.
"""

import argparse
import copy
import sys
import tempfile

import torch

from tensormem.torch import OffloadedAdamW


class TinyGPT(torch.nn.Module):
    def __init__(self, vocab=256, width=128, heads=4, layers=2, context=64):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.position = torch.nn.Parameter(torch.zeros(context, width))
        block = torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, activation="gelu",
                                                 batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        mask = torch.triu(torch.full((context, context), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask)

    def forward(self, ids):
        n = ids.shape[1]
        h = self.embed(ids) + self.position[:n]
        return self.head(self.norm(self.blocks(h, mask=self.mask[:n, :n])))


def batches(steps, batch, context, vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    follow = torch.randint(0, vocab, (vocab,), generator=gen)
    for _ in range(steps):
        ids = torch.empty(batch, context + 1, dtype=torch.long)
        ids[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
        for t in range(1, context + 1):
            noise = torch.rand(batch, generator=gen) < 0.1
            ids[:, t] = torch.where(noise, torch.randint(0, vocab, (batch,), generator=gen), follow[ids[:, t - 1]])
        yield ids[:, :-1], ids[:, 1:]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--swap-dir", action="append", help="a swap folder (repeat to stripe over several)")
    ap.add_argument("--pinned-budget-mib", type=float, default=8.0)
    ap.add_argument("--group-kib", type=int, default=256, help="parameter KiB per sub-group")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    context, vocab = 64, 256
    model = TinyGPT(vocab=vocab, context=context)
    reference = copy.deepcopy(model)
    with tempfile.TemporaryDirectory(prefix="tensormem-offload-") as tmp:
        dirs = args.swap_dir or [tmp]
        opt = OffloadedAdamW(model.parameters(), lr=3e-3, weight_decay=0.01, swap_dirs=dirs,
                             pinned_budget=int(args.pinned_budget_mib * 2**20), group_bytes=args.group_kib << 10)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.01)
        params = sum(p.numel() for p in model.parameters())
        print(f"TinyGPT: {params / 1e6:.2f} M parameters; AdamW state on disk in {', '.join(dirs)} "
              f"({opt.io_stats()['engine']} I/O, {opt.simd} kernel), pinned budget {args.pinned_budget_mib} MiB")
        worst = 0.0
        for step, (x, y) in enumerate(batches(args.steps, args.batch, context, vocab), start=1):
            losses = []
            for m, o in ((model, opt), (reference, ref_opt)):
                o.zero_grad()
                loss = torch.nn.functional.cross_entropy(m(x).reshape(-1, vocab), y.reshape(-1))
                loss.backward()
                o.step()
                losses.append(loss.item())
            worst = max(worst, abs(losses[0] - losses[1]) / abs(losses[1]))
            s = opt.last_stats
            print(f"step {step:3d}  loss {losses[0]:.5f}  (in memory {losses[1]:.5f})  "
                  f"read {s['bytes_read'] / 2**20:.1f} MiB  wrote {s['bytes_written'] / 2**20:.1f} MiB  "
                  f"I/O wait {s['io_wait_seconds'] * 1e3:.1f} ms of {s['seconds'] * 1e3:.1f} ms  "
                  f"overlap {s['overlap_ratio']:.2f}  pinned peak {s['pinned_high_water'] / 2**20:.1f} MiB", flush=True)
        same = all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
        io = opt.io_stats()
        print(f"totals: {opt.totals['bytes_read'] / 2**20:.0f} MiB read, {opt.totals['bytes_written'] / 2**20:.0f} MiB "
              f"written, {opt.totals['io_wait_seconds']:.2f} s waiting on I/O in {opt.totals['seconds']:.2f} s of "
              f"optimizer steps; swap bytes per folder {io['folder_bytes']}; pinned peak "
              f"{io['pinned_peak_in_use'] / 2**20:.1f} MiB of {io['pinned_budget'] / 2**20:.1f} MiB")
        print(f"largest relative loss difference from in-memory AdamW: {worst:.3g}; "
              f"parameters bit-identical: {same}")
        return 0 if worst <= 1e-6 else 1


if __name__ == "__main__":
    sys.exit(main())
