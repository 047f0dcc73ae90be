// The bindings of the norm kernels that read the row as vec4 (norm_reg.wgsl, norm_split.wgsl).
@group(0) @binding(0) var<storage, read> X: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> Wt: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> Bs: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> Y: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> QS: array<u32>;
@group(0) @binding(5) var<storage, read_write> DS: array<vec2<f32>>;
@group(0) @binding(6) var<uniform> P: Params;
