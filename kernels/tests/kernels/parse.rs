//! Names, parsing and wire codes.

use oxccl_kernels::{DType, KernelError, ReduceOp};

#[test]
fn dtype_names_round_trip() {
    let names = [
        "float", "double", "half", "bfloat16", "int8", "uint8", "int32", "uint32", "int64",
        "uint64", "f8e4m3", "f8e5m2",
    ];
    let short = [
        "f32", "f64", "f16", "bf16", "i8", "u8", "i32", "u32", "i64", "u64", "f8e4m3", "f8e5m2",
    ];
    let sizes = [4, 8, 2, 2, 1, 1, 4, 4, 8, 8, 1, 1];
    assert_eq!(DType::ALL.len(), names.len());
    for (i, d) in DType::ALL.into_iter().enumerate() {
        assert_eq!(d.name(), names[i]);
        assert_eq!(d.short_name(), short[i]);
        assert_eq!(d.size(), sizes[i]);
        assert_eq!(d.to_string(), names[i]);
        assert_eq!(d.to_u8() as usize, i);
        assert_eq!(DType::from_u8(d.to_u8()), Some(d));
        assert_eq!(names[i].parse::<DType>(), Ok(d));
        assert_eq!(short[i].parse::<DType>(), Ok(d));
        assert_eq!(names[i].to_uppercase().parse::<DType>(), Ok(d));
        assert_eq!(short[i].to_uppercase().parse::<DType>(), Ok(d));
        assert_eq!(d.to_string().parse::<DType>(), Ok(d));
        assert_eq!(d.is_float(), !(4..10).contains(&i));
    }
    assert_eq!("Float16".parse::<DType>(), Ok(DType::F16));
    assert_eq!(" fp32 ".parse::<DType>(), Ok(DType::F32));
    assert_eq!("float8_e4m3fn".parse::<DType>(), Ok(DType::F8E4M3));
    assert_eq!("FP8_E5M2".parse::<DType>(), Ok(DType::F8E5M2));
    assert_eq!("e4m3".parse::<DType>(), Ok(DType::F8E4M3));
    assert_eq!(DType::from_u8(12), None);
    assert_eq!(DType::from_u8(255), None);
    for bad in ["", "float8", "int16", "i128", "sum"] {
        assert_eq!(
            bad.parse::<DType>(),
            Err(KernelError::UnknownDType(bad.to_owned()))
        );
    }
    let msg = "quux".parse::<DType>().unwrap_err().to_string();
    assert!(msg.contains("quux") && msg.contains("bfloat16"), "{msg}");
}

#[test]
fn op_names_round_trip() {
    let names = ["sum", "prod", "min", "max", "avg"];
    for (i, op) in ReduceOp::ALL.into_iter().enumerate() {
        assert_eq!(op.name(), names[i]);
        assert_eq!(op.to_string(), names[i]);
        assert_eq!(op.to_u8() as usize, i);
        assert_eq!(ReduceOp::from_u8(op.to_u8()), Some(op));
        assert_eq!(names[i].parse::<ReduceOp>(), Ok(op));
        assert_eq!(names[i].to_uppercase().parse::<ReduceOp>(), Ok(op));
    }
    assert_eq!("Avg".parse::<ReduceOp>(), Ok(ReduceOp::Avg));
    assert_eq!(ReduceOp::from_u8(6), None);
    // A pre-multiplied sum: named and coded without its factor, which stays on its rank.
    let pre = ReduceOp::premul_sum(0.25);
    assert_eq!(
        (pre.name(), pre.to_string(), pre.to_u8()),
        ("premul_sum", "premul_sum".into(), 5)
    );
    assert_eq!(pre.factor(), Some(0.25));
    assert_eq!(ReduceOp::Sum.factor(), None);
    assert_eq!(ReduceOp::from_u8(5), Some(ReduceOp::premul_sum(1.0)));
    for name in ["premul_sum", "PREMUL_SUM", " premulsum ", "mulsum"] {
        assert_eq!(
            name.parse::<ReduceOp>(),
            Ok(ReduceOp::premul_sum(1.0)),
            "{name}"
        );
    }
    assert_ne!(ReduceOp::premul_sum(0.5), ReduceOp::premul_sum(2.0));
    assert_eq!(format!("{pre:?}"), "PreMulSum(0.25)");
    for bad in ["", "mean", "float", "summ"] {
        assert_eq!(
            bad.parse::<ReduceOp>(),
            Err(KernelError::UnknownOp(bad.to_owned()))
        );
    }
}
