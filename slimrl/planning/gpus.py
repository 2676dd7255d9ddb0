"""Peak numbers of the accelerators `slimrl plan --time` models, from the vendors' data sheets.

Every figure is a peak per GPU: dense (no 2:4 sparsity) matmul FLOP/s, HBM bandwidth and size,
NVLink bandwidth in one direction (the data sheets quote both directions added), the scale-out
network (the NIC each GPU has on the reference system) and the host link, also one direction.
The step-time model (`step_time.py`) multiplies them by its few efficiency factors; nothing here is
fitted. `measured_cpu` builds the same record from this machine's micro-benchmarks (the CPU twin).
"""

from __future__ import annotations

from dataclasses import dataclass

from slimrl.errors import ConfigError

GB = 1e9
TERA = 1e12


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    name: str
    matmul_flops: float
    """Dense BF16 tensor-core FLOP/s (the training and serving dtype; fp32 on the CPU twin)."""
    fp8_flops: float
    """Dense FP8 tensor-core FLOP/s."""
    hbm_bytes_per_s: float
    memory_gib: float
    nvlink_bytes_per_s: float
    """NVLink bandwidth per GPU, one direction (0: no NVLink, the network carries everything)."""
    nvlink_domain: int
    """GPUs one NVLink domain joins (a node of 8; 72 in a GB200 NVL72 rack)."""
    network_bytes_per_s: float
    """Scale-out bandwidth per GPU, one direction (one 400 Gb/s NIC per GPU on the reference
    systems)."""
    host_bytes_per_s: float
    """GPU <-> host memory, one direction (PCIe Gen5 x16, or NVLink-C2C on Grace superchips)."""
    source: str


def _tb(x: float) -> float:
    return x * TERA


GPUS: dict[str, GpuSpec] = {
    spec.name: spec
    for spec in (
        # NVIDIA H100 Tensor Core GPU data sheet (SXM5): BF16 1,979 / FP8 3,958 TFLOPS with sparsity,
        # 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s (both directions); DGX H100
        # data sheet: 8 single-port ConnectX-7 400 Gb/s for 8 GPUs.
        GpuSpec(
            name="H100",
            matmul_flops=_tb(989.5),
            fp8_flops=_tb(1979),
            hbm_bytes_per_s=3.35e12,
            memory_gib=80 * GB / 2**30,
            nvlink_bytes_per_s=450 * GB,
            nvlink_domain=8,
            network_bytes_per_s=50 * GB,
            host_bytes_per_s=64 * GB,
            source="NVIDIA H100 data sheet (SXM5); DGX H100 data sheet (ConnectX-7 400 Gb/s per GPU)",
        ),
        # NVIDIA H200 Tensor Core GPU data sheet (SXM): compute as H100, 141 GB HBM3e at 4.8 TB/s,
        # NVLink 900 GB/s, PCIe Gen5 128 GB/s; DGX H200: 8 x ConnectX-7 400 Gb/s.
        GpuSpec(
            name="H200",
            matmul_flops=_tb(989.5),
            fp8_flops=_tb(1979),
            hbm_bytes_per_s=4.8e12,
            memory_gib=141 * GB / 2**30,
            nvlink_bytes_per_s=450 * GB,
            nvlink_domain=8,
            network_bytes_per_s=50 * GB,
            host_bytes_per_s=64 * GB,
            source="NVIDIA H200 data sheet (SXM); DGX H200 data sheet",
        ),
        # NVIDIA H20 product brief (HGX H20): BF16 148 / FP8 296 TFLOPS dense, 96 GB HBM3 at 4.0 TB/s,
        # NVLink 900 GB/s, PCIe Gen5 x16. The brief fixes no NIC: 400 Gb/s per GPU assumed, as on
        # the H100/H200 reference systems.
        GpuSpec(
            name="H20",
            matmul_flops=_tb(148),
            fp8_flops=_tb(296),
            hbm_bytes_per_s=4.0e12,
            memory_gib=96 * GB / 2**30,
            nvlink_bytes_per_s=450 * GB,
            nvlink_domain=8,
            network_bytes_per_s=50 * GB,
            host_bytes_per_s=64 * GB,
            source="NVIDIA HGX H20 product brief; NIC assumed 400 Gb/s per GPU",
        ),
        # NVIDIA HGX B200 / DGX B200 data sheets: 8 GPUs give FP8 72 PFLOPS and BF16 36 PFLOPS with
        # sparsity (4.5 / 2.25 PFLOPS dense per GPU), 1,440 GB HBM3e at 64 TB/s (180 GB, 8 TB/s per
        # GPU), NVLink 5 at 1.8 TB/s per GPU, 8 x ConnectX-7 400 Gb/s, PCIe Gen5 hosts.
        GpuSpec(
            name="B200",
            matmul_flops=_tb(2250),
            fp8_flops=_tb(4500),
            hbm_bytes_per_s=8.0e12,
            memory_gib=180 * GB / 2**30,
            nvlink_bytes_per_s=900 * GB,
            nvlink_domain=8,
            network_bytes_per_s=50 * GB,
            host_bytes_per_s=64 * GB,
            source="NVIDIA HGX B200 / DGX B200 data sheets",
        ),
        # NVIDIA GB200 NVL72 data sheet: 72 GPUs give FP8 720 PFLOPS and BF16 360 PFLOPS with
        # sparsity (5 / 2.5 PFLOPS dense per GPU), 13.4 TB HBM3e at 576 TB/s (186 GB, 8 TB/s per GPU),
        # one 72-GPU NVLink domain at 1.8 TB/s per GPU; NVLink-C2C 900 GB/s per Grace and its two GPUs
        # (225 GB/s per GPU and direction); DGX GB200: ConnectX-7 400 Gb/s per GPU.
        GpuSpec(
            name="GB200",
            matmul_flops=_tb(2500),
            fp8_flops=_tb(5000),
            hbm_bytes_per_s=8.0e12,
            memory_gib=186 * GB / 2**30,
            nvlink_bytes_per_s=900 * GB,
            nvlink_domain=72,
            network_bytes_per_s=50 * GB,
            host_bytes_per_s=225 * GB,
            source="NVIDIA GB200 NVL72 data sheet; DGX GB200 (ConnectX-7 400 Gb/s per GPU)",
        ),
    )
}


def gpu_spec(name: str) -> GpuSpec:
    """The spec of `name` (case-insensitive); a ConfigError listing the known ones otherwise."""
    for known, spec in GPUS.items():
        if known.lower() == name.lower():
            return spec
    raise ConfigError(f"--gpu {name}: unknown GPU; known: {', '.join(GPUS)}")


def measured_cpu(matmul_flops: float, copy_bytes_per_s: float, cores: int) -> GpuSpec:
    """The CPU twin: this machine's measured fp32 matmul FLOP/s and warm memory-copy bandwidth
    stand for a GPU's tensor cores and HBM. Host, "NVLink" and network are all its memory: the
    demo's ranks and engines exchange tensors through shared memory and gloo on one host."""
    return GpuSpec(
        name=f"cpu ({cores} cores, measured)",
        matmul_flops=matmul_flops,
        fp8_flops=matmul_flops,
        hbm_bytes_per_s=copy_bytes_per_s,
        memory_gib=0.0,
        nvlink_bytes_per_s=copy_bytes_per_s,
        nvlink_domain=1 << 20,
        network_bytes_per_s=copy_bytes_per_s,
        host_bytes_per_s=copy_bytes_per_s,
        source="measured on this machine (bench/bench_step_time.py)",
    )
