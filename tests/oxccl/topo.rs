//! `oxccl topo`: the groups of the example exactly, node marks, MoE groups, and clear
//! errors for lists that do not fit the world.

use std::process::Command;

fn topo(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_oxccl"))
        .arg("topo")
        .args(args)
        .output()
        .expect("running oxccl topo");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn prints_the_groups_of_the_example_in_creation_order() {
    let (code, out, err) = topo(&["--world", "16", "pipe:2", "tensor:2", "data:4"]);
    assert_eq!(code, 0, "{err}");
    let want = "\
group pipe, ranks: [0, 8]
group pipe, ranks: [1, 9]
group pipe, ranks: [2, 10]
group pipe, ranks: [3, 11]
group pipe, ranks: [4, 12]
group pipe, ranks: [5, 13]
group pipe, ranks: [6, 14]
group pipe, ranks: [7, 15]
group tensor, ranks: [0, 4]
group tensor, ranks: [8, 12]
group tensor, ranks: [1, 5]
group tensor, ranks: [9, 13]
group tensor, ranks: [2, 6]
group tensor, ranks: [10, 14]
group tensor, ranks: [3, 7]
group tensor, ranks: [11, 15]
group data, ranks: [0, 1, 2, 3]
group data, ranks: [4, 5, 6, 7]
group data, ranks: [8, 9, 10, 11]
group data, ranks: [12, 13, 14, 15]
group model, ranks: [0, 4, 8, 12]
group model, ranks: [1, 5, 9, 13]
group model, ranks: [2, 6, 10, 14]
group model, ranks: [3, 7, 11, 15]
";
    assert_eq!(out, want);
}

#[test]
fn marks_groups_inside_one_node() {
    let (code, out, _) = topo(&["pipe:2", "tensor:2", "data:4", "--ranks-per-node", "8"]);
    assert_eq!(code, 0);
    assert!(
        out.contains("group data, ranks: [12, 13, 14, 15]  # node 1\n"),
        "{out}"
    );
    assert!(out.contains("group pipe, ranks: [7, 15]  # nodes 0,1 (crosses nodes)\n"));
}

#[test]
fn moe_groups() {
    let (code, out, _) = topo(&["data:8", "--moe-ep", "4"]);
    assert_eq!(code, 0);
    assert!(out.ends_with(
        "group moe_ep, ranks: [4, 5, 6, 7]\ngroup moe_dp, ranks: [0, 4]\ngroup moe_dp, ranks: [1, 5]\ngroup moe_dp, ranks: [2, 6]\ngroup moe_dp, ranks: [3, 7]\n"
    ), "{out}");
}

#[test]
fn bad_lists_are_clear_errors() {
    let (code, out, err) = topo(&["--world", "16", "data:4", "tensor:3"]);
    assert_eq!(code, 2);
    assert!(out.is_empty());
    assert!(
        err.contains("multiply to 12") && err.contains("16 ranks"),
        "{err}"
    );
    let (code, _, err) = topo(&["tensor:2", "pipe:2"]);
    assert_eq!(code, 2);
    assert!(err.contains("needs a 'data' entry"), "{err}");
    let (code, _, err) = topo(&["data"]);
    assert_eq!(code, 2);
    assert!(err.contains("NAME:SIZE"), "{err}");
    let (code, _, err) = topo(&["data:6", "--moe-ep", "4"]);
    assert_eq!(code, 2);
    assert!(err.contains("must divide"), "{err}");
}

#[test]
fn huge_placements_are_clear_errors() {
    let (code, out, err) = topo(&["a:4294967296", "b:4294967296"]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("multiply to more than"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let (code, _, err) = topo(&["a:65536", "b:65536"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("4294967296 ranks, too many"), "{err}");
    let (code, _, err) = topo(&["--world", "100000000000", "a:2"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--world"), "{err}");
}
