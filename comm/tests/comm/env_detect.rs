//! Launcher detection from fake environments (no process environment involved) and Slurm node
//! list expansion.

use std::collections::HashMap;
use std::path::PathBuf;

use oxccl_comm::bootstrap::{
    detect, expand_nodelist, expand_tasks_per_node, LaunchInfo, Launcher, StoreAddr,
};
use oxccl_comm::Error;

fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn run(pairs: &[(&str, &str)]) -> oxccl_comm::Result<LaunchInfo> {
    let m = env(pairs);
    detect(&|k| m.get(k).cloned())
}

fn ok(pairs: &[(&str, &str)]) -> LaunchInfo {
    run(pairs).unwrap_or_else(|e| panic!("{pairs:?}: {e}"))
}

/// Asserts a Config error whose message contains every needle.
fn config_err(pairs: &[(&str, &str)], needles: &[&str]) -> String {
    match run(pairs) {
        Err(Error::Config(msg)) => {
            for n in needles {
                assert!(
                    msg.contains(n),
                    "{pairs:?}: message {msg:?} should mention {n:?}"
                );
            }
            msg
        }
        other => panic!("{pairs:?}: expected Error::Config, got {other:?}"),
    }
}

fn tcp(host: &str, port: u16) -> StoreAddr {
    StoreAddr::Tcp {
        host: host.to_string(),
        port,
    }
}

// ------------------------------------------------------------------------------------ oxccl

#[test]
fn oxccl_full() {
    let i = ok(&[
        ("OXCCL_RANK", "3"),
        ("OXCCL_WORLD_SIZE", "8"),
        ("OXCCL_LOCAL_RANK", "1"),
        ("OXCCL_LOCAL_WORLD_SIZE", "2"),
        ("OXCCL_STORE", "node1:29400"),
        ("OXCCL_JOB_ID", "job42"),
    ]);
    assert_eq!(
        i,
        LaunchInfo {
            launcher: Launcher::Oxccl,
            rank: 3,
            world_size: 8,
            local_rank: 1,
            local_world_size: 2,
            store: tcp("node1", 29400),
            host_store: false,
            job_id: "job42".into(),
        }
    );
}

#[test]
fn oxccl_defaults_and_hosting() {
    let i = ok(&[
        ("OXCCL_RANK", "0"),
        ("OXCCL_WORLD_SIZE", "4"),
        ("OXCCL_STORE", "10.0.0.1:5000"),
    ]);
    assert_eq!((i.local_rank, i.local_world_size), (0, 4));
    assert!(i.host_store, "rank 0 hosts when no launcher does");
    assert_eq!(i.job_id, "oxccl");

    let i = ok(&[
        ("OXCCL_RANK", "0"),
        ("OXCCL_WORLD_SIZE", "4"),
        ("OXCCL_STORE", "10.0.0.1:5000"),
        ("OXCCL_STORE_HOSTED", "1"),
    ]);
    assert!(!i.host_store, "oxccl launch hosts the server itself");

    let i = ok(&[
        ("OXCCL_RANK", "2"),
        ("OXCCL_WORLD_SIZE", "4"),
        ("OXCCL_STORE", "h:1"),
    ]);
    assert_eq!((i.local_rank, i.local_world_size), (2, 4));
    assert!(!i.host_store);
}

#[test]
fn oxccl_store_forms() {
    let base = [("OXCCL_RANK", "1"), ("OXCCL_WORLD_SIZE", "2")];
    let with = |spec: &'static str| {
        let mut v = base.to_vec();
        v.push(("OXCCL_STORE", spec));
        v
    };
    assert_eq!(ok(&with("[::1]:29500")).store, tcp("::1", 29500));
    assert_eq!(ok(&with("[fd00::7]:1")).store, tcp("fd00::7", 1));
    assert_eq!(
        ok(&with("example.org:65535")).store,
        tcp("example.org", 65535)
    );
    assert_eq!(
        ok(&with("file:///shared/rdzv")).store,
        StoreAddr::File(PathBuf::from("/shared/rdzv"))
    );
    // A file store is never "hosted".
    let mut r0 = with("file:///shared/rdzv");
    r0[0] = ("OXCCL_RANK", "0");
    assert!(!ok(&r0).host_store);

    for bad in [
        "nocolon",
        "::1:29500",
        "h:notaport",
        "h:0",
        "h:65536",
        "file://relative",
        ":80",
    ] {
        config_err(&with(bad), &["OXCCL_STORE", bad]);
    }
}

#[test]
fn oxccl_single_process_without_store() {
    let i = ok(&[("OXCCL_RANK", "0"), ("OXCCL_WORLD_SIZE", "1")]);
    assert_eq!(i.store, tcp("127.0.0.1", 0));
    assert!(i.host_store);
    config_err(
        &[("OXCCL_RANK", "0"), ("OXCCL_WORLD_SIZE", "2")],
        &["OXCCL_STORE"],
    );
}

#[test]
fn validation_names_variable_and_value() {
    config_err(
        &[("OXCCL_RANK", "abc"), ("OXCCL_WORLD_SIZE", "2")],
        &["OXCCL_RANK", "abc"],
    );
    config_err(
        &[("OXCCL_RANK", "-1"), ("OXCCL_WORLD_SIZE", "2")],
        &["OXCCL_RANK", "-1"],
    );
    config_err(
        &[("OXCCL_RANK", "0"), ("OXCCL_WORLD_SIZE", "0")],
        &["OXCCL_WORLD_SIZE", "0"],
    );
    config_err(
        &[
            ("OXCCL_RANK", "4"),
            ("OXCCL_WORLD_SIZE", "4"),
            ("OXCCL_STORE", "h:1"),
        ],
        &["OXCCL_RANK=4", "OXCCL_WORLD_SIZE=4"],
    );
    config_err(
        &[
            ("OXCCL_RANK", "1"),
            ("OXCCL_WORLD_SIZE", "4"),
            ("OXCCL_LOCAL_RANK", "2"),
            ("OXCCL_LOCAL_WORLD_SIZE", "2"),
            ("OXCCL_STORE", "h:1"),
        ],
        &["OXCCL_LOCAL_RANK=2", "OXCCL_LOCAL_WORLD_SIZE=2"],
    );
    config_err(
        &[
            ("OXCCL_RANK", "0"),
            ("OXCCL_WORLD_SIZE", "4"),
            ("OXCCL_LOCAL_WORLD_SIZE", "x"),
            ("OXCCL_STORE", "h:1"),
        ],
        &["OXCCL_LOCAL_WORLD_SIZE", "'x'"],
    );
    config_err(
        &[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_WORLD_SIZE", "0"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ],
        &["LOCAL_WORLD_SIZE=0"],
    );
}

// --------------------------------------------------------------------------------- torchrun

fn torch_base() -> Vec<(&'static str, &'static str)> {
    vec![
        ("RANK", "5"),
        ("WORLD_SIZE", "16"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "4"),
        ("MASTER_ADDR", "trainer-0"),
        ("MASTER_PORT", "29500"),
    ]
}

#[test]
fn torchrun_basic() {
    let i = ok(&torch_base());
    assert_eq!(i.launcher, Launcher::Torchrun);
    assert_eq!(
        (i.rank, i.world_size, i.local_rank, i.local_world_size),
        (5, 16, 1, 4)
    );
    assert_eq!(i.store, tcp("trainer-0", 29500));
    assert!(!i.host_store);
    assert_eq!(i.job_id, "torchrun");

    let mut e = torch_base();
    e[0] = ("RANK", "0");
    e[2] = ("LOCAL_RANK", "0");
    e.push(("TORCHELASTIC_RUN_ID", "run 7"));
    let i = ok(&e);
    assert!(i.host_store);
    assert_eq!(i.job_id, "run_7", "job ids are sanitized");
}

#[test]
fn torchrun_agent_store_uses_next_port() {
    for flag in ["True", "1", "true"] {
        let mut e = torch_base();
        e.push(("TORCHELASTIC_USE_AGENT_STORE", flag));
        assert_eq!(ok(&e).store, tcp("trainer-0", 29501), "flag {flag}");
    }
    for flag in ["False", "0"] {
        let mut e = torch_base();
        e.push(("TORCHELASTIC_USE_AGENT_STORE", flag));
        assert_eq!(ok(&e).store, tcp("trainer-0", 29500), "flag {flag}");
    }
    let mut e = torch_base();
    e[5] = ("MASTER_PORT", "65535");
    e.push(("TORCHELASTIC_USE_AGENT_STORE", "True"));
    config_err(&e, &["MASTER_PORT", "65535"]);
}

#[test]
fn torchrun_missing_master_vars() {
    let e: Vec<_> = torch_base()
        .into_iter()
        .filter(|(k, _)| *k != "MASTER_PORT")
        .collect();
    config_err(&e, &["MASTER_PORT"]);
    let e: Vec<_> = torch_base()
        .into_iter()
        .filter(|(k, _)| !k.starts_with("MASTER"))
        .collect();
    config_err(&e, &["MASTER_ADDR", "MASTER_PORT"]);
    let mut e = torch_base();
    e[5] = ("MASTER_PORT", "http");
    config_err(&e, &["MASTER_PORT", "http"]);
}

#[test]
fn torchrun_ipv6_master_and_oxccl_store_override() {
    let mut e = torch_base();
    e[4] = ("MASTER_ADDR", "[fd00::1]");
    assert_eq!(ok(&e).store, tcp("fd00::1", 29500));
    let mut e = torch_base();
    e.push(("OXCCL_STORE", "file:///nfs/rdzv"));
    assert_eq!(ok(&e).store, StoreAddr::File("/nfs/rdzv".into()));
}

#[test]
fn oxccl_wins_over_torchrun() {
    let mut e = torch_base();
    e.extend([
        ("OXCCL_RANK", "1"),
        ("OXCCL_WORLD_SIZE", "2"),
        ("OXCCL_STORE", "h:9"),
    ]);
    let i = ok(&e);
    assert_eq!(i.launcher, Launcher::Oxccl);
    assert_eq!(i.world_size, 2);
}

// ------------------------------------------------------------------------------------ Slurm

fn slurm_base() -> Vec<(&'static str, &'static str)> {
    vec![
        ("SLURM_PROCID", "5"),
        ("SLURM_NTASKS", "7"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_NODEID", "2"),
        ("SLURM_TASKS_PER_NODE", "2(x3),1"),
        ("SLURM_JOB_ID", "123456"),
        ("SLURM_NODELIST", "gpu[07-09],cpu1"),
    ]
}

#[test]
fn slurm_tasks_per_node_and_derived_store() {
    let i = ok(&slurm_base());
    assert_eq!(i.launcher, Launcher::Slurm);
    assert_eq!(
        (i.rank, i.world_size, i.local_rank, i.local_world_size),
        (5, 7, 1, 2)
    );
    assert_eq!(i.store, tcp("gpu07", 29500 + 456));
    assert!(!i.host_store);
    assert_eq!(i.job_id, "slurm-123456");

    // The last node has one task.
    let mut e = slurm_base();
    e[0] = ("SLURM_PROCID", "6");
    e[2] = ("SLURM_LOCALID", "0");
    e[3] = ("SLURM_NODEID", "3");
    assert_eq!(ok(&e).local_world_size, 1);

    // A node id past the list is only a warning (local sizes are advisory): the list is
    // ignored, the size defaults to 1 and is raised to fit SLURM_LOCALID=1.
    let mut e = slurm_base();
    e[3] = ("SLURM_NODEID", "4");
    let i = ok(&e);
    assert_eq!((i.local_rank, i.local_world_size), (1, 2));

    let mut e = slurm_base();
    e[4] = ("SLURM_TASKS_PER_NODE", "2(y3)");
    config_err(&e, &["SLURM_TASKS_PER_NODE", "2(y3)"]);
}

#[test]
fn slurm_step_counts_win_over_the_job_and_rank0_hosts() {
    // SLURM_NTASKS_PER_NODE is the job's --ntasks-per-node: the step's lists win over it.
    let mut e = slurm_base();
    e[0] = ("SLURM_PROCID", "0");
    e[2] = ("SLURM_LOCALID", "0");
    e.push(("SLURM_NTASKS_PER_NODE", "3"));
    let i = ok(&e);
    assert_eq!(i.local_world_size, 2);
    assert!(i.host_store);
    e.push(("SLURM_STEP_TASKS_PER_NODE", "1,1,4,1"));
    assert_eq!(ok(&e).local_world_size, 4);
    // Only the job's value: used.
    let e: Vec<_> = e
        .into_iter()
        .filter(|(k, _)| !k.contains("TASKS_PER_NODE") || *k == "SLURM_NTASKS_PER_NODE")
        .collect();
    assert_eq!(ok(&e).local_world_size, 3);
    // A malformed step list is still an error naming it.
    let mut e = slurm_base();
    e.push(("SLURM_STEP_TASKS_PER_NODE", "2(x"));
    config_err(&e, &["SLURM_STEP_TASKS_PER_NODE", "2(x"]);
}

#[test]
fn slurm_step_smaller_than_the_jobs_tasks_per_node() {
    // `sbatch --ntasks-per-node=8` then `srun -n 2`: the step sets its own counts.
    let base = [
        ("SLURM_PROCID", "1"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_NODEID", "0"),
        ("SLURM_NTASKS_PER_NODE", "8"),
        ("SLURM_JOB_ID", "77"),
        ("SLURM_NODELIST", "n[1-4]"),
    ];
    let mut e = base.to_vec();
    e.extend([
        ("SLURM_STEP_TASKS_PER_NODE", "2"),
        ("SLURM_TASKS_PER_NODE", "2"),
    ]);
    let i = ok(&e);
    assert_eq!(
        (i.rank, i.world_size, i.local_rank, i.local_world_size),
        (1, 2, 1, 2)
    );
    // Without the step variables the job's 8 exceeds the 2 tasks: a warning, clamped to 2.
    let i = ok(&base);
    assert_eq!((i.local_rank, i.local_world_size), (1, 2));
}

#[test]
fn slurm_store_sources() {
    // Step node list beats the job node list.
    let mut e = slurm_base();
    e.push(("SLURM_STEP_NODELIST", "step[3-4]"));
    assert_eq!(ok(&e).store, tcp("step3", 29956));
    // MASTER_ADDR / MASTER_PORT override.
    let mut e = slurm_base();
    e.extend([("MASTER_ADDR", "head"), ("MASTER_PORT", "4000")]);
    assert_eq!(ok(&e).store, tcp("head", 4000));
    // No job id: base port; job id fallback.
    let e: Vec<_> = slurm_base()
        .into_iter()
        .filter(|(k, _)| *k != "SLURM_JOB_ID")
        .collect();
    let i = ok(&e);
    assert_eq!(i.store, tcp("gpu07", 29500));
    assert_eq!(i.job_id, "slurm");
    // No node list at all and no MASTER_ADDR.
    let e: Vec<_> = slurm_base()
        .into_iter()
        .filter(|(k, _)| *k != "SLURM_NODELIST")
        .collect();
    config_err(&e, &["MASTER_ADDR", "SLURM_NODELIST"]);
    // Malformed node list.
    let mut e = slurm_base();
    e[6] = ("SLURM_NODELIST", "gpu[1-");
    config_err(&e, &["SLURM_NODELIST", "gpu[1-"]);
}

#[test]
fn slurm_minimal_defaults() {
    let i = ok(&[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "1"),
        ("SLURM_NODELIST", "n1"),
    ]);
    assert_eq!((i.local_rank, i.local_world_size), (0, 1));
    assert_eq!(i.store, tcp("n1", 29500));
    config_err(
        &[
            ("SLURM_PROCID", "2"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_NODELIST", "n1"),
        ],
        &["SLURM_PROCID=2", "SLURM_NTASKS=2"],
    );
    // A local rank that does not fit the local size is a warning: the size is raised to fit.
    let i = ok(&[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_NODELIST", "n1"),
    ]);
    assert_eq!((i.local_rank, i.local_world_size), (1, 2));
    // ... and clamped to the world size.
    let i = ok(&[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_LOCALID", "5"),
        ("SLURM_NODELIST", "n1"),
    ]);
    assert_eq!((i.local_rank, i.local_world_size), (1, 2));
}

// --------------------------------------------------------------------------------- Open MPI

#[test]
fn openmpi_with_master_vars() {
    let i = ok(&[
        ("OMPI_COMM_WORLD_RANK", "0"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ("MASTER_ADDR", "10.1.1.1"),
        ("MASTER_PORT", "7000"),
        ("OMPI_MCA_ess_base_jobid", "4242"),
    ]);
    assert_eq!(i.launcher, Launcher::OpenMpi);
    assert_eq!(
        (i.rank, i.world_size, i.local_rank, i.local_world_size),
        (0, 4, 0, 2)
    );
    assert_eq!(i.store, tcp("10.1.1.1", 7000));
    assert!(i.host_store);
    assert_eq!(i.job_id, "4242");
}

#[test]
fn openmpi_store_precedence_and_errors() {
    let base = [("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2")];
    let mut e = base.to_vec();
    e.extend([
        ("OXCCL_STORE", "[::1]:9"),
        ("MASTER_ADDR", "x"),
        ("MASTER_PORT", "1"),
        ("OXCCL_STORE_HOSTED", "1"),
    ]);
    let i = ok(&e);
    assert_eq!(i.store, tcp("::1", 9));
    assert!(!i.host_store);
    assert_eq!(
        (i.local_rank, i.local_world_size),
        (0, 2),
        "local defaults: rank / world"
    );
    assert_eq!(i.job_id, "ompi");

    config_err(&base, &["OXCCL_STORE", "MASTER_ADDR", "MASTER_PORT"]);
    let mut e = base.to_vec();
    e.push(("MASTER_ADDR", "x"));
    let msg = config_err(&e, &["MASTER_PORT"]);
    assert!(msg.contains("missing: MASTER_PORT"), "{msg}");

    // Single process: self-hosted loopback store.
    let i = ok(&[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "1")]);
    assert_eq!(i.store, tcp("127.0.0.1", 0));
    assert!(i.host_store);
}

// ---------------------------------------------------------------------------------- nothing

#[test]
fn nothing_detected_lists_variables() {
    let msg = config_err(
        &[("PATH", "/bin")],
        &[
            "OXCCL_RANK",
            "OXCCL_WORLD_SIZE",
            "RANK",
            "WORLD_SIZE",
            "SLURM_PROCID",
            "SLURM_NTASKS",
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
        ],
    );
    assert!(
        msg.contains("torchrun") && msg.contains("Slurm") && msg.contains("Open MPI"),
        "{msg}"
    );
    // Half a family is reported, and does not count as detected.
    config_err(&[("RANK", "0")], &["RANK is set but WORLD_SIZE is not"]);
    // Empty values count as unset.
    config_err(
        &[("OXCCL_RANK", ""), ("OXCCL_WORLD_SIZE", " ")],
        &["no launcher"],
    );
}

// ------------------------------------------------------------------------- expand_nodelist

#[test]
fn nodelist_expansion() {
    let cases: &[(&str, &[&str])] = &[
        ("node[01-03,07]", &["node01", "node02", "node03", "node07"]),
        ("host1", &["host1"]),
        ("a,b,c", &["a", "b", "c"]),
        (
            "gpu[1-2],cpu[08-10],login",
            &["gpu1", "gpu2", "cpu08", "cpu09", "cpu10", "login"],
        ),
        ("n[9-11]", &["n9", "n10", "n11"]),
        ("n[5]", &["n5"]),
        (
            "rack[1-2]-node[1-2]",
            &["rack1-node1", "rack1-node2", "rack2-node1", "rack2-node2"],
        ),
        ("pre[1-2].suffix", &["pre1.suffix", "pre2.suffix"]),
        ("n[001-002,010]x", &["n001x", "n002x", "n010x"]),
        ("", &[]),
    ];
    for (input, want) in cases {
        assert_eq!(&expand_nodelist(input).unwrap(), want, "input {input:?}");
    }
}

#[test]
fn nodelist_malformed() {
    for bad in [
        "node[1-",
        "node[3-1]",
        "node[]",
        "node[a-b]",
        "node[1-2",
        "node]1[",
        "node[[1]]",
        "a,,b",
        "node[1,]",
        "node[-3]",
        "node[0-99999999]",
    ] {
        match expand_nodelist(bad) {
            Err(Error::Config(msg)) => assert!(msg.contains(bad), "{bad}: {msg}"),
            other => panic!("{bad}: expected Error::Config, got {other:?}"),
        }
    }
}

#[test]
fn tasks_per_node_expansion() {
    assert_eq!(expand_tasks_per_node("2(x3),1").unwrap(), vec![2, 2, 2, 1]);
    assert_eq!(expand_tasks_per_node("8").unwrap(), vec![8]);
    assert_eq!(expand_tasks_per_node("1,4(x2)").unwrap(), vec![1, 4, 4]);
    assert!(expand_tasks_per_node("2(x)").is_err());
    assert!(expand_tasks_per_node("").is_err());
}
