"""What training costs in money: GPU-hours times a price, and what an accelerator-hour costs its owner.
Pure arithmetic.

DeepSeek-V3's report (§1, Table 1) prices its run this way: 2.788M H800 GPU-hours at an assumed
$2 per GPU-hour, $5.576M, for the final training run only (no research, ablations or data).

The total cost of ownership (:func:`tco`) builds such a price from its parts: the purchase amortised
over years, power times the server's overhead, the facility's PUE and the electricity price, all
divided by the share of hours the accelerator does useful work; :func:`usd_per_useful_flop` and
:func:`training_run_usd` then divide by what it computes (peak · MFU). The assumptions are keyword
defaults below, each with its source.
"""

from __future__ import annotations

from dataclasses import dataclass


def training_cost(gpu_hours: float, usd_per_gpu_hour: float) -> float:
    """Dollars for ``gpu_hours`` of accelerator time at ``usd_per_gpu_hour``."""
    if gpu_hours < 0 or usd_per_gpu_hour < 0:
        raise ValueError(f"gpu_hours and usd_per_gpu_hour must be >= 0, got {gpu_hours}, {usd_per_gpu_hour}")
    return gpu_hours * usd_per_gpu_hour


def gpu_hours(total_flops: float, n_gpus: int, peak_flops_per_second: float, mfu: float) -> float:
    """GPU-hours to run ``total_flops`` at model FLOPs utilisation ``mfu`` of each GPU's peak."""
    if not 0 < mfu <= 1 or n_gpus < 1 or peak_flops_per_second <= 0:
        raise ValueError(
            f"need 0 < mfu <= 1, n_gpus >= 1 and a positive peak; got {mfu}, {n_gpus}, {peak_flops_per_second}"
        )
    return total_flops / (peak_flops_per_second * mfu) / 3600


# ---------------------------------------------------------------------- total cost of ownership
# What an accelerator-hour costs its owner: the purchase spread over its useful life, plus the
# electricity it and its share of the server and the cooling draw, divided by the share of hours it
# does useful work. Every default below is an assumption, stated with where it comes from; lecture 07
# varies them. Not included: staff, buildings, networking and storage beyond the server (put them in
# capex_usd per accelerator if you know them), cost of capital, resale value.

HOURS_PER_YEAR = 24 * 365.25
# Straight-line depreciation period. Hyperscalers depreciate servers over 5-6 years (their annual
# reports since 2022-2023); an accelerator's economic life is often taken shorter, since each
# generation lowers the price per FLOP. 4 years is a middle assumption.
YEARS = 4.0
# Power of the whole server over its accelerators' own: NVIDIA DGX H100 datasheet, 10.2 kW maximum for
# eight 700 W GPUs (10.2 / 5.6 = 1.82): CPUs, memory, NICs, NVSwitches, fans.
SYSTEM_POWER_FACTOR = 1.8
# Power usage effectiveness, facility power / IT power. Uptime Institute's 2024 survey: 1.56 on
# average; large new facilities report 1.1-1.2 (Google's fleet: 1.10 in 2023). 1.3 is in between.
PUE = 1.3
# US average industrial electricity price, about 8 cents per kWh in 2023 (US EIA, Electric Power
# Monthly); Chinese industrial tariffs are similar (0.6-0.7 CNY/kWh).
USD_PER_KWH = 0.08
# Share of paid hours spent training: Llama 3 (Dubey et al. 2024, §3.3.4) reports "higher than 90%
# effective training time" on 16k H100s, after failures, restarts and checkpointing.
UTILISATION = 0.9
# Model FLOPs utilisation while training: Llama 3 405B 38-43% (Dubey et al. 2024, Table 4); PaLM 540B
# 46.2% (Chowdhery et al. 2022, §4.1).
MFU = 0.4


def amortised_capex_per_hour(capex_usd: float, years: float = YEARS) -> float:
    """Dollars per hour of owning: capex / (years · 8766 h), straight-line, no resale value."""
    if capex_usd < 0 or years <= 0:
        raise ValueError(f"need capex_usd >= 0 and years > 0, got {capex_usd}, {years}")
    return capex_usd / (years * HOURS_PER_YEAR)


def power_cost_per_hour(
    watts: float, system_power_factor: float = SYSTEM_POWER_FACTOR, pue: float = PUE, usd_per_kwh: float = USD_PER_KWH
) -> float:
    """Dollars per hour of electricity: watts · system factor · PUE / 1000 · $/kWh, at full power
    (an accelerator that waits still draws a good part of it; the upper bound is the safe side)."""
    if watts <= 0 or system_power_factor < 1 or pue < 1 or usd_per_kwh < 0:
        raise ValueError(
            f"need watts > 0, system_power_factor >= 1, pue >= 1, usd_per_kwh >= 0; got {watts}, "
            f"{system_power_factor}, {pue}, {usd_per_kwh}"
        )
    return watts * system_power_factor * pue / 1000 * usd_per_kwh


@dataclass(frozen=True)
class TCO:
    """The hourly cost of owning one accelerator: amortised capex and power, and the share of hours
    (``utilisation``) in which it does useful work."""

    accelerator: str
    capex_usd_per_hour: float
    power_usd_per_hour: float
    utilisation: float

    @property
    def usd_per_hour(self) -> float:
        """Cost of one hour held, used or not."""
        return self.capex_usd_per_hour + self.power_usd_per_hour

    @property
    def usd_per_useful_hour(self) -> float:
        """Cost of one hour of useful work: idle hours are paid for by the busy ones."""
        return self.usd_per_hour / self.utilisation


def tco(
    accelerator,
    capex_usd: float,
    *,
    years: float = YEARS,
    system_power_factor: float = SYSTEM_POWER_FACTOR,
    pue: float = PUE,
    usd_per_kwh: float = USD_PER_KWH,
    utilisation: float = UTILISATION,
    power_watts: float | None = None,
) -> TCO:
    """The :class:`TCO` of one :class:`~course_lib.cost.hardware.Accelerator` bought for ``capex_usd``
    (the accelerator with its share of the server: prices are not in the table, the caller states
    them). Power is the table's ``power_watts``; a part whose power is not published raises, unless
    ``power_watts`` states an assumption."""
    if not 0 < utilisation <= 1:
        raise ValueError(f"utilisation is a share of hours, 0 < utilisation <= 1; got {utilisation}")
    watts = power_watts if power_watts is not None else accelerator.power_watts.value
    if watts is None:
        raise ValueError(
            f"{accelerator.name} has no published power figure ({accelerator.power_watts.source}); pass "
            f"power_watts=... to state an assumption, or leave the part out of the comparison"
        )
    return TCO(
        accelerator.name,
        amortised_capex_per_hour(capex_usd, years),
        power_cost_per_hour(watts, system_power_factor, pue, usd_per_kwh),
        utilisation,
    )


def usd_per_useful_flop(cost: TCO, peak_flops_per_second: float, mfu: float = MFU) -> float:
    """Dollars per model FLOP: the cost of a useful hour over the FLOPs it delivers, peak · MFU · 3600."""
    return cost.usd_per_useful_hour * gpu_hours(1.0, 1, peak_flops_per_second, mfu)


def training_run_usd(total_flops: float, cost: TCO, peak_flops_per_second: float, mfu: float = MFU) -> float:
    """Dollars of owning the accelerators for a run of ``total_flops`` model FLOPs: the GPU-hours at
    ``mfu`` (:func:`gpu_hours`), each at the cost of a useful hour (idle hours included)."""
    return training_cost(gpu_hours(total_flops, 1, peak_flops_per_second, mfu), cost.usd_per_useful_hour)
