"""How near each of Muon's iterations comes to the polar factor ``U V^T`` of an SVD, in the
same number of matrix products: the singular values of the result (1 for the exact factor)
and its distance to the factor, relative, for random and ill-conditioned matrices, with the
iteration in float32 and in bfloat16.

    python benchmarks/polar_factors.py              # 5 steps
    python benchmarks/polar_factors.py --steps 6

Cases: Gaussian matrices of BERT-base's shapes (768 x 768, 768 x 3072) and ones whose singular
values spread log-evenly over 2 and 3 decades (768 x 512). The iteration normalizes by the
Frobenius norm first, so a matrix's smallest singular value starts at sigma_min / ||X||_F; Polar
Express's coefficients are designed for values from 1e-3 up.
"""

from __future__ import annotations

import argparse

import torch

from scaleopt._orthogonal import NS_METHODS, newton_schulz


def with_spectrum(rows: int, cols: int, decades: float, gen: torch.Generator) -> torch.Tensor:
    u, _ = torch.linalg.qr(torch.randn(rows, rows, dtype=torch.float64, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(cols, cols, dtype=torch.float64, generator=gen))
    k = min(rows, cols)
    s = torch.logspace(0, -decades, k, dtype=torch.float64)
    return (u[:, :k] * s) @ v[:, :k].T


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    cases = {
        "Gaussian 768 x 768": torch.randn(768, 768, dtype=torch.float64, generator=gen),
        "Gaussian 768 x 3072": torch.randn(768, 3072, dtype=torch.float64, generator=gen),
        "2 decades 768 x 512": with_spectrum(768, 512, 2, gen),
        "3 decades 768 x 512": with_spectrum(768, 512, 3, gen),
    }
    print(f"{args.steps} steps; singular values of the result [min, max] (and of the middle 98%),"
          f" relative distance to U V^T")
    print("| matrix | sigma_min/norm | iteration | dtype | singular values | middle 98% | distance |")
    print("|---|---:|---|---|---|---|---:|")
    for name, x in cases.items():
        u, s, vh = torch.linalg.svd(x, full_matrices=False)
        factor = u @ vh
        floor = (s.min() / s.square().sum().sqrt()).item()
        for method in NS_METHODS:
            for dtype in (torch.float32, torch.bfloat16):
                y = newton_schulz(x.float(), method, args.steps, 1e-7, dtype).double()
                sv = torch.linalg.svdvals(y).sort().values
                k = len(sv) // 100
                distance = ((y - factor).norm() / factor.norm()).item()
                print(f"| {name} | {floor:.1e} | {method} | {str(dtype)[6:]} | "
                      f"[{sv[0]:.3f}, {sv[-1]:.3f}] | [{sv[k]:.3f}, {sv[-1 - k]:.3f}] | "
                      f"{distance:.3f} |")


if __name__ == "__main__":
    main()
