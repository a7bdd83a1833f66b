"""Per-request LoRA adapters over one base model (issue 34): PEFT adapters read and
checked (peft_files), stacked in device slots that the model's projections read per
token (stacks, ops), and a manager that moves them between disk, host and device
(manager). A step mixes adapters freely: each sequence carries its adapter's slot."""

from backend_gpu.lora.manager import LoRAManager
from backend_gpu.lora.peft_files import AdapterInfo, AdapterWeights, BaseShapes
from backend_gpu.lora.stacks import LoRAStacks

__all__ = ["AdapterInfo", "AdapterWeights", "BaseShapes", "LoRAManager", "LoRAStacks"]
