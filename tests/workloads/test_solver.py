"""autotune.workloads.ups.solver: the pseudo-spectral PDE solvers keep their invariants."""

from __future__ import annotations

import numpy as np
import pytest

from autotune.workloads.ups.solver import PHYSICS, grid, random_initial_fields, solve

T_FINAL, SNAPSHOTS, DT = 2.0, 9, 2e-3


def _initial(n_points: int, n_traj: int = 12, seed: int = 0) -> np.ndarray:
    return random_initial_fields(np.random.default_rng(seed), n_traj, n_points)


def test_initial_fields_are_smooth_and_normalised() -> None:
    u0 = _initial(32)
    assert u0.shape == (12, 2, 32)
    np.testing.assert_allclose(np.abs(u0).max(axis=-1), 1.0)
    spectrum = np.abs(np.fft.rfft(u0))
    assert spectrum[..., 5:].max() < 1e-12  # only the first 4 Fourier modes
    np.testing.assert_allclose(grid(4), [0, np.pi / 2, np.pi, 3 * np.pi / 2])


def test_solve_shape_and_first_snapshot() -> None:
    u0 = _initial(32, n_traj=3)
    out = solve("burgers", u0, T_FINAL, SNAPSHOTS, DT)
    assert out.shape == (3, SNAPSHOTS, 2, 32) and out.dtype == np.float64
    np.testing.assert_array_equal(out[:, 0], u0)


def test_advection_preserves_the_l2_norm() -> None:
    speed = np.random.default_rng(1).uniform(-1, 1, 12)
    out = solve("advection", _initial(32), T_FINAL, SNAPSHOTS, DT, speed=speed)
    norms = np.linalg.norm(out, axis=-1)  # (traj, snapshot, field)
    np.testing.assert_allclose(norms, np.broadcast_to(norms[:, :1], norms.shape), rtol=1e-6)
    assert np.abs(out[:, -1] - out[:, 0]).max() > 0.1  # it did move


def test_advection_is_a_shift_at_the_given_speed() -> None:
    n = 32
    u0 = _initial(n)
    speed = np.random.default_rng(2).uniform(-1, 1, 12)
    out = solve("advection", u0, T_FINAL, SNAPSHOTS, DT, speed=speed)
    k = np.fft.rfftfreq(n, d=1.0 / n)
    times = np.linspace(0, T_FINAL, SNAPSHOTS)
    for s, t in enumerate(times):  # exact solution u0(x − a t), shifted spectrally
        exact = np.fft.irfft(np.fft.rfft(u0) * np.exp(-1j * k * speed[:, None, None] * t), n=n)
        np.testing.assert_allclose(out[:, s], exact, atol=1e-8)


def test_burgers_conserves_the_mean_of_u() -> None:
    out = solve("burgers", _initial(32), T_FINAL, SNAPSHOTS, DT)
    mean = out[:, :, 0].mean(axis=-1)
    np.testing.assert_allclose(mean, np.broadcast_to(mean[:, :1], mean.shape), rtol=0, atol=1e-10)


def test_burgers_energy_does_not_increase() -> None:
    out = solve("burgers", _initial(32), T_FINAL, SNAPSHOTS, DT)
    energy = (out[:, :, 0] ** 2).sum(axis=-1)  # (traj, snapshot)
    assert (np.diff(energy, axis=1) <= 1e-12 * energy[:, :-1]).all()
    assert (energy[:, -1] < energy[:, 0]).all()  # viscosity dissipates


def test_burgers_tracer_stays_within_its_initial_bounds() -> None:
    """Maximum principle of c_t + u c_x = κ c_xx, on a grid that resolves the Burgers fronts.

    (On coarse grids such as the tiny preset's 32 points the spectral solution has Gibbs
    overshoots, so the bound holds only when the fronts are resolved.)
    """
    u0 = _initial(256, n_traj=16)
    out = solve("burgers", u0, T_FINAL, SNAPSHOTS, DT)
    c = out[:, :, 1]
    lo, hi = c[:, 0].min(axis=-1, keepdims=True), c[:, 0].max(axis=-1, keepdims=True)
    tol = 1e-3 * (hi - lo)
    assert (c.min(axis=-1) >= lo - tol).all()
    assert (c.max(axis=-1) <= hi + tol).all()
    assert np.abs(c[:, -1] - c[:, 0]).max() > 0.1  # the tracer was carried


def test_burgers_tracer_in_a_uniform_flow_is_advected_and_diffused() -> None:
    """With u ≡ a the tracer equation is linear: each Fourier mode moves at a and decays as e^{-κk²t}."""
    n = 32
    u0 = _initial(n, n_traj=4)
    speed = np.array([0.5, -0.3, 1.0, 0.0])
    u0[:, 0] = speed[:, None]
    out = solve("burgers", u0, T_FINAL, SNAPSHOTS, DT, nu=0.02, kappa=0.01)
    np.testing.assert_allclose(out[:, :, 0], np.broadcast_to(speed[:, None, None], out[:, :, 0].shape), atol=1e-12)
    k = np.fft.rfftfreq(n, d=1.0 / n)
    for s, t in enumerate(np.linspace(0, T_FINAL, SNAPSHOTS)):
        factor = np.exp((-1j * k * speed[:, None] - 0.01 * k**2) * t)
        np.testing.assert_allclose(out[:, s, 1], np.fft.irfft(np.fft.rfft(u0[:, 1]) * factor, n=n), atol=1e-8)


def test_burgers_small_amplitude_decays_at_the_viscous_rate() -> None:
    """At tiny amplitude the nonlinearity vanishes: sin(3x) decays as e^{-9νt}."""
    eps, nu = 1e-6, 0.02
    x = grid(32)
    u0 = np.zeros((1, 2, 32))
    u0[0, 0] = eps * np.sin(3 * x)
    out = solve("burgers", u0, T_FINAL, SNAPSHOTS, DT, nu=nu)
    exact = eps * np.exp(-9 * nu * np.linspace(0, T_FINAL, SNAPSHOTS))[:, None] * np.sin(3 * x)
    np.testing.assert_allclose(out[0, :, 0], exact, rtol=0, atol=1e-4 * eps)


def test_solve_rejects_unknown_physics() -> None:
    with pytest.raises(ValueError, match=r"unknown physics 'heat'; known: burgers, advection"):
        solve("heat", _initial(16, n_traj=1), T_FINAL, SNAPSHOTS, DT)
    assert PHYSICS == ("burgers", "advection")


def test_solve_reports_divergence() -> None:
    with np.errstate(all="ignore"), pytest.raises(FloatingPointError, match="diverged"):
        solve("burgers", 50 * _initial(32, n_traj=2), T_FINAL, 3, 0.5)
