"""The accelerators the course talks about: one table, every figure with its source.

Lecture 07 draws every plot and every roofline from this table, and lecture 07's communication
arithmetic reads its link bandwidths from here: a figure is typed once, in this file.

Units are SI throughout: FLOP/s, bytes, bytes/s, watts. Compute is the **dense** peak (vendors
print the 2:4-sparsity figure, twice as large, in the same datasheets: it is not used here).
HBM capacities are as the vendor prints them, read as 10⁹ bytes per GB. Link bandwidths are
**per GPU, per direction**: NVIDIA quotes NVLink as the sum of both directions (900 GB/s on an H100
SXM is 450 GB/s each way), and a ring collective's speed is set by one direction.

Each figure is a :class:`Figure` that names its source. ``estimate=True`` marks a figure that no
vendor document gives (derived from a related part, or read from press reports); ``disputed`` holds
the range when sources disagree, with the value chosen and why. The domestic parts (Ascend, MLU,
DCU) are documented far less openly than NVIDIA's; their rows are mostly estimates, and lecture 07
says so wherever it uses them. ``None`` means not published (or, for a precision, not supported).

Sources named below:
* NVIDIA datasheets: A100 Tensor Core GPU (2021), H100 Tensor Core GPU (2023), H200 Tensor Core
  GPU (2024), DGX B200 / HGX B200 (2024); the H800 brief's figures as summarised by Zhao et al. (below).
* Zhao et al., "Insights into DeepSeek-V3: Scaling Challenges and Reflections on Hardware
  for AI Architectures", ISCA 2025, §4.1 (H800: NVLink cut from 900 to 400 GB/s, eight 400 Gb/s IB
  NICs per node) and §4.3 (NVLink 200 GB/s of which ~160 GB/s achievable, ~40 GB/s effective IB).
* Huawei: Atlas 800T A2 / Atlas 300T A2 product pages (910B); Zuo et al., "Serving Large Language
  Models on Huawei CloudMatrix384", arXiv:2506.12708, 2025, §3 (910C); Gitee AI's Ascend 910B
  documentation (a lower 910B figure).
* Cambricon: MLU370-X8 product page; press reports for the MLU590 (no public datasheet).
* Hygon: DCU Z100 ("深算一号") press reports; its design descends from AMD's Vega 20 (Instinct MI50),
  whose datasheet is used where Hygon publishes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from course_lib.cost.roofline import ridge_point

PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8", "fp4")
GB = 1e9
TB = 1e12
TFLOPS = 1e12


@dataclass(frozen=True)
class Figure:
    """One number from one source. ``value`` in SI units, or ``None`` when not published/supported."""

    value: float | None
    source: str
    estimate: bool = False
    disputed: str = ""
    note: str = ""

    def __post_init__(self):
        if not self.source:
            raise ValueError("every hardware figure names its source")
        if self.value is not None and self.value <= 0:
            raise ValueError(f"a hardware figure is positive or None, got {self.value} from {self.source}")

    @property
    def flagged(self) -> bool:
        """True when the figure should be read with care: an estimate, or sources disagree."""
        return self.estimate or bool(self.disputed)


@dataclass(frozen=True)
class Accelerator:
    """One accelerator: dense peak compute per precision, memory, links and power."""

    name: str
    vendor: str
    year: int
    flops: dict[str, Figure]
    hbm_bytes: Figure
    hbm_bytes_per_s: Figure
    scale_up: str
    scale_up_bytes_per_s: Figure
    scale_out_bytes_per_s: Figure
    power_watts: Figure
    notes: str = ""
    memory: str = "HBM"  # the memory technology behind hbm_bytes (the field names say HBM, as most parts have)
    figures: dict[str, Figure] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        unknown = set(self.flops) - set(PRECISIONS)
        if unknown or set(self.flops) != set(PRECISIONS):
            raise ValueError(f"{self.name}: give a Figure for each precision {PRECISIONS}; extra/missing: {unknown}")
        figures = {f"flops_{p}": f for p, f in self.flops.items()}
        for key in ("hbm_bytes", "hbm_bytes_per_s", "scale_up_bytes_per_s", "scale_out_bytes_per_s", "power_watts"):
            figures[key] = getattr(self, key)
        object.__setattr__(self, "figures", figures)

    def peak_flops(self, precision: str) -> float:
        """Dense peak FLOP/s in ``precision``; a clear error when the part has no such format."""
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r} is not one of {PRECISIONS}")
        value = self.flops[precision].value
        if value is None:
            raise ValueError(
                f"{self.name} has no published dense {precision} peak (the format is unsupported or the "
                f"figure unknown: {self.flops[precision].source}); pick another precision"
            )
        return value

    def ridge_point(self, precision: str = "bf16") -> float:
        """FLOP/byte where the roofline's two limits meet: peak / HBM bandwidth (Williams et al. 2009;
        the formula and the rest of the roofline: :mod:`course_lib.cost.roofline`)."""
        return ridge_point(self.peak_flops(precision), self.hbm_bytes_per_s.value)


def _flops(source: str, **values) -> dict[str, Figure]:
    """Per-precision figures from one source; a value may be a Figure to override the source or flags."""
    out = {}
    for p in PRECISIONS:
        v = values.get(p)
        out[p] = v if isinstance(v, Figure) else Figure(v * TFLOPS if v else None, source)
    return out


_A100 = "NVIDIA A100 datasheet (SXM4 80GB)"
_H100 = "NVIDIA H100 datasheet (SXM5)"
_H200 = "NVIDIA H200 datasheet (SXM)"
_B200 = "NVIDIA HGX/DGX B200 datasheet (per GPU = system figure / 8)"
_ZHAO_ISCA25 = "Zhao et al., Insights into DeepSeek-V3, ISCA 2025, §4.1, §4.3"
_CM384 = "Zuo et al., Serving LLMs on Huawei CloudMatrix384, arXiv:2506.12708, §3"
_MI50 = "AMD Instinct MI50 datasheet (the Vega 20 design Hygon's DCU descends from)"

A100 = Accelerator(
    "A100",
    "NVIDIA",
    2020,
    _flops(_A100, fp32=19.5, tf32=156, bf16=312, fp16=312),
    Figure(80 * GB, _A100),
    Figure(2.039 * TB, _A100),
    "NVLink 3",
    Figure(300 * GB, _A100, note="600 GB/s both directions"),
    Figure(25 * GB, "NVIDIA DGX A100 datasheet: one 200 Gb/s HDR InfiniBand port per GPU"),
    Figure(400, _A100),
)

H100 = Accelerator(
    "H100",
    "NVIDIA",
    2022,
    _flops(_H100, fp32=67, tf32=494.7, bf16=989.4, fp16=989.4, fp8=1978.9),
    Figure(80 * GB, _H100),
    Figure(3.35 * TB, _H100),
    "NVLink 4",
    Figure(450 * GB, _H100, note="900 GB/s both directions"),
    Figure(50 * GB, "NVIDIA DGX H100 datasheet: one 400 Gb/s NDR InfiniBand port per GPU"),
    Figure(700, _H100),
)

H800 = Accelerator(
    "H800",
    "NVIDIA",
    2023,
    _flops(
        _ZHAO_ISCA25 + ": Hopper compute as H100 (only FP64 and NVLink reduced)",
        fp32=67,
        tf32=494.7,
        bf16=989.4,
        fp16=989.4,
        fp8=1978.9,
    ),
    Figure(80 * GB, _ZHAO_ISCA25 + ": H100-class SXM part"),
    Figure(3.35 * TB, "NVIDIA H800 SXM5 brief, as H100 SXM5", estimate=True, note="not in the seeds"),
    "NVLink 4 (cut to 400 GB/s)",
    Figure(200 * GB, _ZHAO_ISCA25, note="400 GB/s both directions; §4.3: ~160 GB/s achieved"),
    Figure(50 * GB, _ZHAO_ISCA25, note="eight 400 Gb/s CX7 NICs per 8-GPU node; ~40 GB/s effective"),
    Figure(700, "NVIDIA H800 SXM5 brief, as H100 SXM5", estimate=True),
    notes="export-compliant H100: NVLink 900 -> 400 GB/s, FP64 reduced (Zhao et al., ISCA 2025, §4.1)",
)

H200 = Accelerator(
    "H200",
    "NVIDIA",
    2024,
    _flops(_H200, fp32=67, tf32=494.7, bf16=989.4, fp16=989.4, fp8=1978.9),
    Figure(141 * GB, _H200),
    Figure(4.8 * TB, _H200),
    "NVLink 4",
    Figure(450 * GB, _H200, note="900 GB/s both directions"),
    Figure(50 * GB, "HGX H200 reference design: one 400 Gb/s NIC per GPU", estimate=True, note="depends on the server"),
    Figure(700, _H200, note="configurable up to 700 W"),
)

B200 = Accelerator(
    "B200",
    "NVIDIA",
    2024,
    _flops(_B200, fp32=75, tf32=1100, bf16=2250, fp16=2250, fp8=4500, fp4=9000),
    Figure(
        180 * GB, "NVIDIA DGX B200 datasheet (1,440 GB / 8)", disputed="180-192 GB: 192 GB in the 2024 launch material"
    ),
    Figure(8 * TB, _B200),
    "NVLink 5",
    Figure(900 * GB, _B200, note="1.8 TB/s both directions"),
    Figure(50 * GB, "NVIDIA DGX B200 datasheet: eight 400 Gb/s ConnectX-7 ports"),
    Figure(1000, _B200, disputed="1000 W (HGX B200) to 1200 W (in GB200 systems)"),
)

ASCEND_910B = Accelerator(
    "Ascend 910B",
    "Huawei",
    2023,
    _flops(
        "Huawei Atlas 800T A2 material and press reports",
        bf16=Figure(
            320 * TFLOPS,
            "press reports of Atlas 800T A2 (910B)",
            estimate=True,
            disputed="280 (Gitee AI 910B docs) to 376 (per-die figure in the CloudMatrix384 paper); 910B bins differ",
        ),
        fp16=Figure(
            320 * TFLOPS,
            "press reports of Atlas 800T A2 (910B)",
            estimate=True,
            disputed="280 (Gitee AI 910B docs) to 376 (per-die figure in the CloudMatrix384 paper)",
        ),
    ),
    Figure(64 * GB, "Gitee AI Ascend 910B documentation (64 GB HBM2e)"),
    Figure(1.6 * TB, "press reports", estimate=True, disputed="1.2-1.6 TB/s in press reports"),
    "HCCS",
    Figure(
        196 * GB,
        "Atlas 800T A2: 7 HCCS links x 56 GB/s = 392 GB/s",
        estimate=True,
        note="taken as both directions, like NVIDIA's figure: Huawei does not say",
    ),
    Figure(25 * GB, "Atlas 800T A2: eight 200 GE RoCE ports per 8-NPU server"),
    Figure(400, "Atlas 300T A2 card (910B)", estimate=True, disputed="310-400 W across reports and bins"),
    notes="no FP8/FP4 units; FP32 and TF32 matrix peaks not published",
)

ASCEND_910C = Accelerator(
    "Ascend 910C",
    "Huawei",
    2025,
    _flops(
        _CM384,
        bf16=Figure(752 * TFLOPS, _CM384 + ": two dies x 376", disputed="752-800 TFLOPS; press reports round to 800"),
        fp16=Figure(752 * TFLOPS, _CM384 + ": two dies x 376", disputed="752-800 TFLOPS; press reports round to 800"),
    ),
    Figure(128 * GB, _CM384 + ": 2 x 64 GB"),
    Figure(3.2 * TB, _CM384 + ": 2 x 1.6 TB/s"),
    "Unified Bus (UB)",
    Figure(392 * GB, _CM384, estimate=True, note="UB plane, summed over both dies; treat as an estimate"),
    Figure(50 * GB, _CM384 + ": RDMA plane, one 400 Gb/s port per NPU", estimate=True),
    Figure(None, "not published for the chip alone"),
    notes="two 910B-class dies in one package; FP8 arrives with the Ascend 950 (Huawei roadmap, 2025)",
)

MLU370 = Accelerator(
    "MLU370-X8",
    "Cambricon",
    2022,
    _flops("Cambricon MLU370-X8 product page", fp32=24, bf16=96, fp16=96),
    Figure(48 * GB, "Cambricon MLU370-X8 product page (LPDDR5, not HBM)"),
    Figure(614.4 * GB, "Cambricon MLU370-X8 product page"),
    "MLU-Link",
    Figure(
        100 * GB, "Cambricon MLU370-X8 product page: 200 GB/s MLU-Link", estimate=True, note="taken as both directions"
    ),
    Figure(None, "not specified: PCIe card, the server's NIC decides"),
    Figure(250, "Cambricon MLU370-X8 product page"),
    notes="a PCIe card with LPDDR5: built for inference and mid-size training",
    memory="LPDDR5",
)

MLU590 = Accelerator(
    "MLU590",
    "Cambricon",
    2023,
    _flops(
        "press reports (no public datasheet)",
        bf16=Figure(314 * TFLOPS, "press reports (no public datasheet)", estimate=True, disputed="~256-314 TFLOPS"),
        fp16=Figure(314 * TFLOPS, "press reports (no public datasheet)", estimate=True, disputed="~256-314 TFLOPS"),
    ),
    Figure(80 * GB, "press reports (HBM2e)", estimate=True),
    Figure(2.0 * TB, "press reports", estimate=True, disputed="~1.8-2.7 TB/s"),
    "MLU-Link",
    Figure(None, "not published"),
    Figure(None, "not published"),
    Figure(350, "press reports", estimate=True),
    notes="Cambricon's training part; every figure is an estimate",
)

HYGON_DCU = Accelerator(
    "DCU Z100",
    "Hygon",
    2021,
    _flops(
        _MI50,
        fp32=Figure(13.3 * TFLOPS, _MI50, estimate=True, disputed="12-15 TFLOPS in press reports of the Z100"),
        fp16=Figure(26.5 * TFLOPS, _MI50, estimate=True, disputed="26-32 TFLOPS in press reports"),
    ),
    Figure(32 * GB, "press reports of the Z100 (HBM2)"),
    Figure(1.0 * TB, "press reports of the Z100", disputed="1.0-1.02 TB/s"),
    "xGMI (Infinity Fabric)",
    Figure(92 * GB, _MI50 + ": 184 GB/s Infinity Fabric", estimate=True, note="taken as both directions"),
    Figure(None, "not specified: PCIe card, the server's NIC decides"),
    Figure(300, _MI50, estimate=True, disputed="250-300 W"),
    notes="GPGPU with a CUDA-like (ROCm/HIP) stack; no bf16 matrix units published; an old part, listed for the ecosystem",
)

ACCELERATORS: dict[str, Accelerator] = {
    a.name: a for a in (A100, H100, H800, H200, B200, ASCEND_910B, ASCEND_910C, MLU370, MLU590, HYGON_DCU)
}


def get(name: str | Accelerator) -> Accelerator:
    """The accelerator called ``name`` (as in :data:`ACCELERATORS`), with a clear error otherwise; an
    :class:`Accelerator` (one of the table's, or one a learner describes) is returned as it is."""
    if isinstance(name, Accelerator):
        return name
    try:
        return ACCELERATORS[name]
    except KeyError:
        raise KeyError(f"no accelerator {name!r} in the table; known: {sorted(ACCELERATORS)}") from None


def rows() -> list[dict]:
    """The table as plain rows (one per accelerator and figure) for a DataFrame or a printed table."""
    out = []
    for acc in ACCELERATORS.values():
        for key, fig in acc.figures.items():
            out.append(
                dict(
                    accelerator=acc.name,
                    figure=key,
                    value=fig.value,
                    source=fig.source,
                    estimate=fig.estimate,
                    disputed=fig.disputed,
                    note=fig.note,
                )
            )
    return out
