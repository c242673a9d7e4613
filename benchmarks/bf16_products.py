"""The products of a Linear's per-sample norm on bfloat16 records (an autocast forward's
activations ``a`` and grad_outputs ``g``), on a CUDA device: today's read (both promoted to
float32, products in TF32: ``gradhooks.base.utils.tf32_products``) against bfloat16 operands with
a float32 result (``torch.bmm(..., out_dtype=torch.float32)``: exact products, float32
accumulation, the bfloat16 tensor-core rate). Both forms: the Gram (ghost) norm
``sum_{t,s} (a_t . a_s)(g_t . g_s)`` (Goodfellow 2015; Li et al. 2022, sec. 4) and the
materialised ``||g^T a||_F^2``. Error: max relative error of the squared norms against float64.
GPT-2 small's Linear shapes at B x T = 32 x 512 by default. CUDA-event timing, medians.

    python benchmarks/bf16_products.py [--batch 32] [--seq 512] [--repeats 10] [--out FILE]
"""
import argparse

import torch


def median_ms(fn, repeats):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def forms(a, g):
    """{name: () -> (B,) squared norms}: the four variants."""
    def tf32(fn):
        def run():
            flag = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = True
            try:
                return fn(a.float(), g.float())
            finally:
                torch.backends.cuda.matmul.allow_tf32 = flag
        return run

    def gram(x, y, **kw):
        return (torch.bmm(x, x.transpose(1, 2), **kw) * torch.bmm(y, y.transpose(1, 2), **kw)).sum((1, 2))

    def direct(x, y, **kw):
        return torch.bmm(y.transpose(1, 2), x, **kw).square().sum((1, 2))

    f32 = {"out_dtype": torch.float32}
    return {"Gram, float32 in TF32": tf32(gram), "Gram, bf16 -> float32": lambda: gram(a, g, **f32),
            "materialised, float32 in TF32": tf32(direct),
            "materialised, bf16 -> float32": lambda: direct(a, g, **f32)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", help="also write the markdown table here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (bfloat16 products with a float32 result are CUDA-only in torch)")
    torch.manual_seed(0)
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, B x T = {args.batch} x "
             f"{args.seq}, medians of {args.repeats}", "",
             "| in -> out | form | ms | max rel err (float64 ref) |", "|---|---|--:|--:|"]
    for i, o in [(768, 2304), (768, 768), (768, 3072), (3072, 768)]:
        a = torch.randn(args.batch, args.seq, i, device="cuda").bfloat16()
        g = (torch.randn(args.batch, args.seq, o, device="cuda") * 1e-3).bfloat16()
        ad, gd = a.double(), g.double()
        ref = ((ad @ ad.transpose(1, 2)) * (gd @ gd.transpose(1, 2))).sum((1, 2))
        for name, fn in forms(a, g).items():
            err = ((fn().double() - ref).abs() / ref.abs()).max().item()
            lines.append(f"| {i} -> {o} | {name} | {median_ms(fn, args.repeats):.3f} | {err:.1e} |")
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("# bfloat16 records' norm products on a GPU\n\n`python benchmarks/bf16_products.py`\n\n"
                    + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
