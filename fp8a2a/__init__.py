"""fp8a2a: FP8 all-to-all for Mixture-of-Experts dispatch and combine."""
from .dispatcher import DispatchHandle, DispatchOutput, Dispatcher, DispatcherConfig
from .experts import ExpertsConfig, FP8GroupedMLP, grouped_linear
from .quant import QuantizedTensor, dequantize, quantize, scale_for_tensor
from .weight_cache import expert_weights, invalidate_fp8_weight_cache
from .wire import CountsCol, Granularity

__version__ = "0.1.0"
__all__ = ["quantize", "dequantize", "QuantizedTensor", "scale_for_tensor", "Dispatcher", "DispatchOutput",
           "DispatchHandle", "FP8GroupedMLP", "grouped_linear", "expert_weights", "invalidate_fp8_weight_cache",
           "DispatcherConfig", "ExpertsConfig", "Granularity", "CountsCol"]
