//! Device memory of the wgpu back end against what a GPU budget counts for it: loading weights
//! holds the weights' bytes (`compute::wgpu::weight_bytes`) plus at most the back end's fixed
//! bytes (`backend_fixed_bytes`: the allocator's unused block ends and one upload piece), read
//! from the allocator's own report of the blocks it holds (what the driver gave it), right after
//! the load, before any submit of ours could release a staging copy.
//!
//! The weights are 2 x 72 MiB on the GPU: a load that kept a staging copy of each until the
//! next submit (wgpu's `mapped_at_creation` on a weight buffer did, 0.35-0.9 GB over a 4 GB
//! budget on the H200) holds 144 MiB more, which the fixed allowance (about 81 MiB) does not
//! cover.
//!
//! Needs the `wgpu` feature; no adapter is a failure unless `DISKFORMER_NO_GPU=1`.
#![cfg_attr(not(feature = "wgpu"), allow(unused))]

#[cfg(not(feature = "wgpu"))]
#[test]
fn gpu_memory_needs_the_wgpu_feature() {
    println!("gpu_memory: compute was built without the wgpu feature; run with --features wgpu");
}

#[cfg(feature = "wgpu")]
mod gpu_common;

#[cfg(feature = "wgpu")]
#[test]
fn loading_weights_holds_their_bytes_and_the_fixed_allowance() {
    use compute::quant::GgmlType;
    use compute::Backend;
    use gpu_common::{gpu, WeightFile};

    let Some(b) = gpu("gpu_memory") else { return };
    let (rows, k) = (8192, 8192);
    let names = ["a.weight", "b.weight"];
    let specs: Vec<_> = names.iter().map(|n| (n.to_string(), GgmlType::Q8_0, vec![rows, k], Vec::new())).collect();
    let file = WeightFile::new("gpu-memory", &specs);
    let before = b.device_reserved_bytes().expect("a Vulkan adapter reports its allocator's blocks");
    let weights: Vec<_> = names.iter().map(|n| b.weight(&file.get(n)).expect("uploads")).collect();
    let after = b.device_reserved_bytes().expect("reports");
    let weight_bytes: u64 = names.len() as u64 * compute::wgpu::weight_bytes(GgmlType::Q8_0, rows, k).unwrap();
    let allowance = compute::wgpu::backend_fixed_bytes();
    let grew = after.saturating_sub(before);
    println!(
        "allocator: {before} B before, {after} B after loading {weight_bytes} B of weights (+{grew} B); allowance {allowance} B"
    );
    assert!(grew >= weight_bytes, "the allocator holds {grew} B more, less than the weights' {weight_bytes} B");
    assert!(
        grew <= weight_bytes + allowance,
        "loading {weight_bytes} B of weights took {grew} B of device memory, more than the weights and the {allowance} B the budget allows for"
    );
    drop(weights);
}
