"""Pseudo-spectral solvers for the `ups` workload's PDE data (NumPy only).

Two 1D families on the periodic domain [0, 2π), each with two fields (u, c):

* ``burgers``: viscous Burgers for the velocity u and a passive tracer c carried by it,
      u_t + (u²/2)_x = ν u_xx,     c_t + u c_x = κ c_xx
  (u in conservation form, so its mean is invariant; c in advective form, so where the grid
  resolves the fronts it obeys a maximum principle and stays within its initial extremes;
  the tiny preset's 32-point grid does not resolve them and overshoots)
* ``advection``: linear advection of both fields at a constant speed a,
      u_t + a u_x = 0,             c_t + a c_x = 0

Space: Fourier collocation with 2/3-rule dealiasing of the products. Time: classical RK4
with an integrating factor for the diffusion term (exact for the stiff linear part), so
the explicit step is limited only by the advective CFL number. Many trajectories are
integrated at once (the FFTs are batched over axis 0).
"""

from __future__ import annotations

import numpy as np

PHYSICS = ("burgers", "advection")


def grid(n_points: int) -> np.ndarray:
    """Collocation points x_j = 2πj/N."""
    return 2 * np.pi * np.arange(n_points) / n_points


def random_initial_fields(rng: np.random.Generator, n_traj: int, n_points: int, max_mode: int = 4) -> np.ndarray:
    """Smooth random fields: sums of the first `max_mode` Fourier modes. Shape (n_traj, 2, N)."""
    x = grid(n_points)
    k = np.arange(1, max_mode + 1)
    amp = rng.normal(size=(n_traj, 2, max_mode)) / k  # decaying spectrum
    phase = rng.uniform(0, 2 * np.pi, size=(n_traj, 2, max_mode))
    fields = (amp[..., None] * np.sin(k[None, None, :, None] * x + phase[..., None])).sum(axis=2)
    return fields / np.maximum(np.abs(fields).max(axis=-1, keepdims=True), 1e-6)  # peak |u| = 1


def solve(
    physics: str,
    initial: np.ndarray,
    t_final: float,
    n_snapshots: int,
    dt: float,
    nu: float = 0.02,
    kappa: float = 0.01,
    speed: np.ndarray | None = None,
) -> np.ndarray:
    """Integrate `initial` (n_traj, 2, N) to `t_final`; return (n_traj, n_snapshots, 2, N).

    Snapshot 0 is the initial state; the rest are evenly spaced in time up to t_final.
    `speed` (n_traj,) is the advection speed for ``advection`` (default 1).
    """
    if physics not in PHYSICS:
        raise ValueError(f"unknown physics {physics!r}; known: {', '.join(PHYSICS)}")
    n_traj, n_fields, n = initial.shape
    k = np.fft.rfftfreq(n, d=1.0 / n)  # integer wavenumbers 0..N/2
    ik = 1j * k
    dealias = k < (2.0 / 3.0) * (n / 2)
    if physics == "burgers":
        diffusion = -np.array([nu, kappa])[:, None] * k**2  # (2, K): linear, diagonal in Fourier space
    else:
        diffusion = np.zeros((2, k.size))
    a = np.ones(n_traj) if speed is None else np.asarray(speed, dtype=np.float64)

    def nonlinear(v_hat: np.ndarray) -> np.ndarray:
        """Explicit right-hand side in Fourier space (without the diffusion term)."""
        if physics == "advection":
            return -a[:, None, None] * ik * v_hat
        u = np.fft.irfft(v_hat[:, 0] * dealias, n=n)
        cx = np.fft.irfft(ik * v_hat[:, 1] * dealias, n=n)
        rhs_u = -ik * np.fft.rfft(0.5 * u * u)  # -(u²/2)_x: its k = 0 mode is exactly 0
        rhs_c = np.fft.rfft(-u * cx)
        return np.stack([rhs_u, rhs_c], axis=1) * dealias

    steps_per_snapshot = max(1, round(t_final / (n_snapshots - 1) / dt))
    h = t_final / (n_snapshots - 1) / steps_per_snapshot
    e_half = np.exp(diffusion * h / 2)
    e_full = np.exp(diffusion * h)

    v = np.fft.rfft(initial.astype(np.float64))
    out = np.empty((n_traj, n_snapshots, n_fields, n), dtype=np.float64)
    out[:, 0] = initial
    for s in range(1, n_snapshots):
        for _ in range(steps_per_snapshot):
            # Integrating-factor RK4 (Lawson): diffusion is applied exactly via e^{Lh}.
            k1 = nonlinear(v)
            k2 = nonlinear(e_half * (v + h / 2 * k1))
            k3 = nonlinear(e_half * v + h / 2 * k2)
            k4 = nonlinear(e_full * v + h * e_half * k3)
            v = e_full * v + h / 6 * (e_full * k1 + 2 * e_half * (k2 + k3) + k4)
        out[:, s] = np.fft.irfft(v, n=n)
    if not np.isfinite(out).all():
        raise FloatingPointError(f"{physics} solver diverged; lower dt (now {dt})")
    return out
