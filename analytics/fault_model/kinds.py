"""The catalogue of finding kinds: every ``kind`` a finding of gpuhealth can carry.

A finding's kind comes from its rule (``ecc``, ``row_remap``, ``telemetry_gap``), from the
event kind it rests on (``xid``, ``sxid``, ``host_memory``), from the online detectors
(``anomaly``) or from the service itself (``collector_outage``). ``[[policy.rule]]``
``kind`` must be one of these: a rule with a misspelt kind (``xidd``) would never match,
and the configuration check refuses it (``gpuhealth config check``). A test keeps this
list a superset of the kinds the code writes (``tests/unit/test_fresh_user_16.py``).
"""

from __future__ import annotations

FINDING_KINDS: frozenset[str] = frozenset({
    # GPU and driver (kernel log, nvidia-smi, NVML, DCGM)
    "xid", "sxid", "gpu_lost", "gpu_init_failure", "gpu_identity", "reset_required",
    "reboot_required", "recovery_action", "ecc", "ecc_event", "row_remap", "retired_pages",
    "noisy_sbe", "throttle", "thermal", "thermal_violation", "cooling", "nvml_error",
    "nvidia_smi_err", "cuda_error", "dcgm_health", "dcgm_diag", "dcgm_diag_error",
    "dcgm_diag_perf", "diagnostic", "driver_reload", "driver_load", "driver_mismatch",
    "gsp_error", "uvm_fatal", "nvlink", "nvls", "nvswitch_inventory", "fabric",
    "fabric_manager", "pcie", "pcie_link", "peermem", "host_memory", "kernel_boot",
    "monitoring_agent",
    # network (InfiniBand, RoCE, Ethernet, bonds) and collectives
    "ib_port", "ib_port_state", "ib_fabric", "ib_counter_saturated", "ibdiagnet_stage",
    "nic_port", "link_down", "symbol_burst", "bond", "bond_member_flap", "netdev_counter_rise",
    "rdma_async", "rdma_counters", "rdma_transport", "rdma_verbs", "roce_qos",
    "noisy_replay", "nccl", "nccl_gdr", "nccl_result", "nccl_socket", "collective",
    "collective_timeout", "ofi_completion", "shm",
    # Kubernetes and the scheduler
    "kube_condition", "kube_taint", "pod", "slurm_job", "workload",
    # telemetry, detectors and the service itself
    "telemetry", "telemetry_gap", "gap_closed", "counter_reset", "anomaly", "peer",
    "stable", "collector_gap", "collector_outage", "gpuhealth",
})
"""Every finding kind (module docstring)."""
