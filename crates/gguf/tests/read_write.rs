//! Reading: every fixture file's tensor infos against the listing llama.cpp's tools recorded in
//! ref.json; writing: round trips of every value type; bad files: each refused with an error that
//! names the problem and the numbers.

use gguf::{GgmlType, GgufError, GgufModel, GgufWriter, Value, ValueType};
use std::path::{Path, PathBuf};

fn fixture_root() -> (PathBuf, bool) {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let shared = repo.join("../shared/fixtures");
    if shared.join("README.md").exists() {
        (shared, true)
    } else {
        (repo.join("tests/fixtures"), false)
    }
}

#[test]
fn fixture_tensor_infos_match_ref_json() {
    let (root, full) = fixture_root();
    println!("fixture set: {} ({})", root.display(), if full { "full" } else { "compact subset" });
    let mut n_files = 0;
    for dir in std::fs::read_dir(&root).unwrap().flatten() {
        let Ok(text) = std::fs::read_to_string(dir.path().join("ref.json")) else {
            continue;
        };
        let text = text.replace("-Infinity", "-1e308").replace("Infinity", "1e308").replace("NaN", "null");
        let r: serde_json::Value = serde_json::from_str(&text).unwrap();
        for (variant, v) in r["llama_cpp"].as_object().unwrap() {
            let Some(file) = v["file"].as_str() else {
                continue;
            };
            let path = dir.path().join(file);
            if !path.exists() {
                continue;
            }
            let Some(tensors) = v["tensors"].as_object() else {
                continue;
            };
            let m = GgufModel::open(&path).unwrap();
            assert_eq!(m.architecture().unwrap(), r["gguf_arch"].as_str().unwrap(), "{variant}");
            assert_eq!(m.n_tensors(), tensors.len(), "{}", path.display());
            for (name, t) in tensors {
                let ours = m.tensor(name).unwrap();
                assert_eq!(ours.dtype().name(), t["type"].as_str().unwrap(), "{name} in {}", path.display());
                let shape: Vec<u64> = t["shape"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
                assert_eq!(ours.shape(), &shape[..], "{name}");
            }
            n_files += 1;
        }
    }
    println!("{n_files} files checked");
    assert!(!full || n_files >= 14 * 8, "expected every variant of the full set, got {n_files}");
}

fn every_value_type() -> Vec<(&'static str, Value)> {
    vec![
        ("a.u8", Value::U8(200)),
        ("a.i8", Value::I8(-5)),
        ("a.u16", Value::U16(60000)),
        ("a.i16", Value::I16(-30000)),
        ("a.u32", Value::U32(4_000_000_000)),
        ("a.i32", Value::I32(-2_000_000_000)),
        ("a.f32", Value::F32(1.5)),
        ("a.bool", Value::Bool(true)),
        ("a.string", Value::String("héllo ✓".into())),
        ("a.u64", Value::U64(u64::MAX)),
        ("a.i64", Value::I64(i64::MIN)),
        ("a.f64", Value::F64(-2.25)),
        ("a.empty", Value::Array(ValueType::U32, vec![])),
        ("a.strings", Value::Array(ValueType::String, vec![Value::String("x".into()), Value::String("".into())])),
        (
            "a.nested",
            Value::Array(
                ValueType::Array,
                vec![
                    Value::Array(ValueType::I32, vec![Value::I32(1), Value::I32(-2)]),
                    Value::Array(ValueType::String, vec![Value::String("deep".into())]),
                ],
            ),
        ),
    ]
}

fn write_tiny(path: &Path, alignment: Option<u32>) -> Vec<u8> {
    let mut w = GgufWriter::new();
    if let Some(a) = alignment {
        w.set("general.alignment", Value::U32(a));
    }
    w.set("general.architecture", Value::String("llama".into()));
    for (k, v) in every_value_type() {
        w.set(k, v);
    }
    w.add_tensor("a", GgmlType::F32, &[3]).unwrap();
    w.add_tensor("b", GgmlType::Q8_0, &[32, 2]).unwrap();
    let a: Vec<u8> = [1.0f32, 2.0, 3.0].iter().flat_map(|v| v.to_le_bytes()).collect();
    let b: Vec<u8> = (0..68u8).collect();
    let mut sink = w.create(path).unwrap();
    sink.write_data(&a).unwrap();
    // In two chunks: the writer must accept data in any pieces.
    sink.write_data(&b[..10]).unwrap();
    sink.write_data(&b[10..]).unwrap();
    sink.finish().unwrap();
    std::fs::read(path).unwrap()
}

#[test]
fn writer_round_trips_every_value_type_and_alignment() {
    let dir = tempfile::tempdir().unwrap();
    for align in [None, Some(64), Some(4096)] {
        let p = dir.path().join(format!("t{align:?}.gguf"));
        write_tiny(&p, align);
        let m = GgufModel::open(&p).unwrap();
        let md = m.metadata();
        for (k, v) in every_value_type() {
            assert_eq!(md.get(k), Some(&v), "{k}");
        }
        let f = &m.files()[0];
        assert_eq!(f.alignment, align.unwrap_or(32) as u64);
        assert_eq!(f.data_offset % f.alignment, 0);
        assert_eq!(
            m.tensor("a").unwrap().data,
            &[1.0f32, 2.0, 3.0].iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>()[..]
        );
        assert_eq!(m.tensor("b").unwrap().data, &(0..68u8).collect::<Vec<_>>()[..]);
        assert_eq!(m.tensor("b").unwrap().info.offset % f.alignment, 0);
    }
}

#[test]
fn typed_getters_name_the_key_on_wrong_types() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.gguf");
    write_tiny(&p, None);
    let m = GgufModel::open(&p).unwrap();
    let md = m.metadata();
    assert_eq!(md.u32("a.u16").unwrap(), 60000);
    let e = md.u32("a.string").unwrap_err().to_string();
    assert!(e.contains("a.string") && e.contains("string") && e.contains("u32"), "{e}");
    let e = md.u32("a.i64").unwrap_err().to_string();
    assert!(e.contains("out of range"), "{e}");
    let e = md.u32("no.such.key").unwrap_err().to_string();
    assert!(e.contains("no.such.key") && e.contains("missing"), "{e}");
}

/// Byte offsets in the tiny file: the first tensor info starts after the metadata.
fn header_len_before_tensor_infos(bytes: &[u8]) -> usize {
    // Find the name of tensor "a" (u64 length 1, then 'a') after the metadata.
    let needle = [1u8, 0, 0, 0, 0, 0, 0, 0, b'a', 1, 0, 0, 0];
    bytes.windows(needle.len()).rposition(|w| w == needle).unwrap()
}

fn open_bytes(bytes: &[u8]) -> Result<GgufModel, GgufError> {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.gguf");
    std::fs::write(&p, bytes).unwrap();
    GgufModel::open(&p)
}

fn err_of(bytes: &[u8]) -> String {
    let e = open_bytes(bytes).expect_err("a bad file must be refused");
    let s = e.to_string();
    assert!(s.contains("bad.gguf"), "error must name the file: {s}");
    s
}

#[test]
fn bad_files_are_refused_with_numbers() {
    let dir = tempfile::tempdir().unwrap();
    let good = write_tiny(&dir.path().join("good.gguf"), None);
    let ti = header_len_before_tensor_infos(&good);

    let mut b = good.clone();
    b[..4].copy_from_slice(b"GGML");
    assert!(err_of(&b).contains("magic"));

    // Version 2 has the same layout as 3 (3 only added big-endian files): it must open.
    let mut b = good.clone();
    b[4..8].copy_from_slice(&2u32.to_le_bytes());
    assert_eq!(open_bytes(&b).unwrap().files()[0].version, 2);

    let mut b = good.clone();
    b[4..8].copy_from_slice(&7u32.to_le_bytes());
    assert!(err_of(&b).contains("unsupported GGUF version 7"));

    for cut in [3, 10, 30, ti + 5] {
        let e = err_of(&good[..cut]);
        assert!(e.contains("truncated") || e.contains("magic"), "cut at {cut}: {e}");
    }

    // Data truncated: the header is whole but tensor b's bytes are not all there.
    let e = err_of(&good[..good.len() - 1]);
    assert!(e.contains("\"b\"") && e.contains("past the end"), "{e}");

    // Unknown tensor type: tensor a's type id sits after name(9) + n_dims(4) + dims(8).
    let mut b = good.clone();
    let type_at = ti + 9 + 4 + 8;
    b[type_at..type_at + 4].copy_from_slice(&4u32.to_le_bytes());
    let e = err_of(&b);
    assert!(e.contains("unknown tensor type id 4"), "{e}");

    // Dimension product that overflows.
    let mut b = good.clone();
    b[ti + 13..ti + 21].copy_from_slice(&u64::MAX.to_le_bytes());
    let e = err_of(&b);
    assert!(e.contains("overflow") || e.contains("int64"), "{e}");

    // Overlapping tensors: point b's offset at a's.
    let mut b = good.clone();
    let b_info = ti + 9 + 4 + 8 + 4 + 8; // tensor a's info is name, n_dims, 1 dim, type, offset
    let off_at = b_info + 9 + 4 + 16 + 4;
    b[off_at..off_at + 8].copy_from_slice(&0u64.to_le_bytes());
    let e = err_of(&b);
    assert!(e.contains("overlap"), "{e}");

    // Misaligned offset.
    let mut b = good.clone();
    b[off_at..off_at + 8].copy_from_slice(&33u64.to_le_bytes());
    let e = err_of(&b);
    assert!(e.contains("alignment"), "{e}");

    // A metadata value of an unknown type: the first key's type id follows magic(4) + version(4)
    // + counts(16) + key length(8) + key.
    let mut b = good.clone();
    let first_key_len = u64::from_le_bytes(b[24..32].try_into().unwrap()) as usize;
    let t_at = 32 + first_key_len;
    b[t_at..t_at + 4].copy_from_slice(&99u32.to_le_bytes());
    let e = err_of(&b);
    assert!(e.contains("unknown value type 99"), "{e}");

    // An array length that the file cannot hold is refused before allocating.
    let mut w = GgufWriter::new();
    w.set("big", Value::Array(ValueType::U64, vec![Value::U64(1)]));
    let p = dir.path().join("arr.gguf");
    w.create(&p).unwrap().finish().unwrap();
    let mut b = std::fs::read(&p).unwrap();
    let len_at = 24 + 8 + 3 + 4 + 4;
    b[len_at..len_at + 8].copy_from_slice(&(1u64 << 60).to_le_bytes());
    let e = err_of(&b);
    assert!(e.contains("truncated") && e.contains("big"), "{e}");
}

#[test]
fn split_sets_open_as_one_model() {
    let dir = tempfile::tempdir().unwrap();
    let count = 3u16;
    for no in 0..count {
        let mut w = GgufWriter::new();
        if no == 0 {
            w.set("general.architecture", Value::String("llama".into()));
        }
        w.set(gguf::KEY_SPLIT_NO, Value::U16(no));
        w.set(gguf::KEY_SPLIT_COUNT, Value::U16(count));
        w.set(gguf::KEY_SPLIT_TENSORS_COUNT, Value::I32(3));
        w.add_tensor(&format!("t{no}"), GgmlType::F32, &[2]).unwrap();
        let p = gguf::split_path(dir.path(), "m", no as u32, count as u32);
        let mut s = w.create(&p).unwrap();
        s.write_data(&[no as u8; 8]).unwrap();
        s.finish().unwrap();
    }
    let second = dir.path().join("m-00002-of-00003.gguf");
    let m = GgufModel::open(&second).unwrap();
    assert_eq!(m.files().len(), 3);
    assert_eq!(m.architecture().unwrap(), "llama");
    for no in 0..3u8 {
        assert_eq!(m.tensor(&format!("t{no}")).unwrap().data, &[no; 8]);
    }
    std::fs::remove_file(dir.path().join("m-00003-of-00003.gguf")).unwrap();
    let e = GgufModel::open(&second).unwrap_err().to_string();
    assert!(e.contains("part 3 of 3 is missing"), "{e}");
}
