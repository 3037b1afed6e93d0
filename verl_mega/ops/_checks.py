"""Argument checks shared by the ops: bad input fails with an error that names the argument."""
import torch


def require_tensor(name: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def require_floating(name: str, value) -> None:
    require_tensor(name, value)
    if not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor (float32, bfloat16, ...), got {value.dtype}")


def require_integer(name: str, value) -> None:
    require_tensor(name, value)
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {value.dtype}")


def require_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: tensor.device for name, tensor in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors must be on one device, got {devices}")
