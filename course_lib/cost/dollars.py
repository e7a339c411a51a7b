"""What training costs in money: GPU-hours times a price. Pure arithmetic.

DeepSeek-V3's report (§1, Table 1) prices its run this way: 2.788M H800 GPU-hours at an assumed
$2 per GPU-hour, $5.576M, for the final training run only (no research, ablations or data).
"""

from __future__ import annotations


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
