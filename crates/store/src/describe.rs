//! What `models list` says about a GGUF: architecture and quant, read from its header.

use gguf::GgufModel;
use std::collections::HashMap;

/// `general.file_type` values (`enum llama_ftype`, include/llama.h at llama.cpp 0c1e570) and
/// the names llama.cpp's quantize tool gives them. 4-6 and 33-35 were removed from ggml.
const FILE_TYPES: &[(u32, &str)] = &[
    (0, "F32"),
    (1, "F16"),
    (2, "Q4_0"),
    (3, "Q4_1"),
    (7, "Q8_0"),
    (8, "Q5_0"),
    (9, "Q5_1"),
    (10, "Q2_K"),
    (11, "Q3_K_S"),
    (12, "Q3_K_M"),
    (13, "Q3_K_L"),
    (14, "Q4_K_S"),
    (15, "Q4_K_M"),
    (16, "Q5_K_S"),
    (17, "Q5_K_M"),
    (18, "Q6_K"),
    (19, "IQ2_XXS"),
    (20, "IQ2_XS"),
    (21, "Q2_K_S"),
    (22, "IQ3_XS"),
    (23, "IQ3_XXS"),
    (24, "IQ1_S"),
    (25, "IQ4_NL"),
    (26, "IQ3_S"),
    (27, "IQ3_M"),
    (28, "IQ2_S"),
    (29, "IQ2_M"),
    (30, "IQ4_XS"),
    (31, "IQ1_M"),
    (32, "BF16"),
    (36, "TQ1_0"),
    (37, "TQ2_0"),
    (38, "MXFP4_MOE"),
];

/// The name of a `general.file_type` value, or `None` for one this table does not know.
pub fn file_type_name(ftype: u32) -> Option<&'static str> {
    FILE_TYPES.iter().find(|(id, _)| *id == ftype).map(|(_, n)| *n)
}

/// The quant of a model: `general.file_type` when present and known, else the type holding
/// the most bytes among its tensors (what a file without the key mostly is).
pub fn quant_of(model: &GgufModel) -> Option<String> {
    if let Ok(Some(ft)) = model.metadata().u32_opt("general.file_type") {
        if let Some(n) = file_type_name(ft) {
            return Some(n.to_string());
        }
    }
    let mut bytes: HashMap<gguf::GgmlType, u64> = HashMap::new();
    for t in model.tensors() {
        *bytes.entry(t.dtype()).or_default() += t.info.size_bytes;
    }
    bytes.into_iter().max_by_key(|&(t, b)| (b, std::cmp::Reverse(t))).map(|(t, _)| t.name().to_string())
}

/// `general.architecture`, when present.
pub fn architecture_of(model: &GgufModel) -> Option<String> {
    model.metadata().str_opt("general.architecture").ok().flatten().map(str::to_string)
}
