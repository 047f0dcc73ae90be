//! Quantized tensor types: dequantization, dot products and quantization.
