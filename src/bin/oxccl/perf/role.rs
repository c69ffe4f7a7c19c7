//! Whether this `oxccl perf` process is one rank of a job a launcher started, or the parent
//! that starts `--np` local ranks itself, decided from `--np` and the launchers' variables.

use oxccl_comm::bootstrap::{detect, Launcher};

/// The rank variables of the launchers `oxccl perf` runs under.
const RANK_VARS: [&str; 4] = ["OXCCL_RANK", "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"];

/// The launchers' rank and world-size variables, as named in warnings.
const LAUNCHER_VARS: [&str; 8] = [
    "OXCCL_RANK",
    "OXCCL_WORLD_SIZE",
    "RANK",
    "WORLD_SIZE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
];

/// How this process takes part in the run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Role {
    /// One rank of a job a launcher started; `warning`: why the job may never assemble.
    Rank { warning: Option<String> },
    /// The parent that starts `--np` local ranks; `ignored`: the launcher variables an explicit
    /// `--np` overrides, and why.
    Parent { ignored: Option<String> },
}

pub(super) type Lookup<'a> = &'a dyn Fn(&str) -> Option<String>;

/// Decides the [`Role`] from `--np` and the environment (`get`).
///
/// Without launcher variables this process is the parent. With them and no `--np`, it is a
/// rank. With them and an explicit `--np`, it is a rank only when the launcher's world size is
/// `--np` and the launcher really started it as a rank; otherwise `--np` wins (as torchrun's
/// `--nproc-per-node` does): the launcher's variables are ignored, with a warning.
pub(super) fn role(np: Option<usize>, get: Lookup<'_>) -> Role {
    let set = |k: &str| get(k).filter(|v| !v.trim().is_empty());
    if !RANK_VARS.iter().any(|k| set(k).is_some()) {
        return Role::Parent { ignored: None };
    }
    let found: Vec<String> = LAUNCHER_VARS
        .iter()
        .filter_map(|k| set(k).map(|v| format!("{k}={v}")))
        .collect();
    let found = found.join(", ");
    let info = detect(get);
    let batch = info
        .as_ref()
        .is_ok_and(|i| slurm_batch_script(get, &i.launcher));
    let Some(np) = np else {
        let warning = match (&info, batch) {
            (Ok(i), true) if i.world_size > 1 => Some(format!(
                "{found} are set but SLURM_STEP_ID is not: this looks like a Slurm batch script, \
                 not a task started by srun, so rank {} may wait (up to OXCCL_TIMEOUT) for {} \
                 peers that never start; start the ranks with srun, or give --np N to start N \
                 local ranks here",
                i.rank,
                i.world_size - 1
            )),
            _ => None,
        };
        return Role::Rank { warning };
    };
    let why = match &info {
        Ok(_) if batch => "SLURM_STEP_ID is not set, so this is a Slurm batch script, not a \
                           task started by srun"
            .to_owned(),
        Ok(i) if i.world_size == np => return Role::Rank { warning: None },
        Ok(i) => format!(
            "they describe a job of {} ranks, not {np} (to run as one of those ranks, leave out \
             --np)",
            i.world_size
        ),
        Err(e) => format!("they do not describe a whole job ({e})"),
    };
    Role::Parent {
        ignored: Some(format!(
            "--np {np} was given but launcher variables are set ({found}); {why}: starting {np} \
             local ranks here and ignoring them"
        )),
    }
}

/// Whether the Slurm variables come from a batch script (`sbatch`), where `SLURM_PROCID` is 0
/// and `SLURM_NTASKS` the allocation's task count although srun started no task: srun sets
/// `SLURM_STEP_ID` in every task it starts.
fn slurm_batch_script(get: Lookup<'_>, launcher: &Launcher) -> bool {
    let set = |k: &str| get(k).is_some_and(|v| !v.trim().is_empty());
    *launcher == Launcher::Slurm && !set("SLURM_STEP_ID") && !set("SLURM_STEPID")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn role_in(np: Option<usize>, vars: &[(&str, &str)]) -> Role {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        role(np, &|k| {
            vars.iter()
                .find(|(name, _)| name == k)
                .map(|(_, v)| v.clone())
        })
    }

    const SBATCH: [(&str, &str); 4] = [
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "4"),
        ("SLURM_JOB_ID", "77"),
        ("SLURM_NODELIST", "node1"),
    ];

    fn ignored(r: &Role) -> &str {
        match r {
            Role::Parent { ignored: Some(w) } => w,
            other => panic!("expected a parent overriding the launcher, got {other:?}"),
        }
    }

    #[test]
    fn no_launcher_makes_a_parent() {
        assert_eq!(role_in(None, &[]), Role::Parent { ignored: None });
        assert_eq!(role_in(Some(4), &[]), Role::Parent { ignored: None });
        assert_eq!(
            role_in(Some(4), &[("RANK", " ")]),
            Role::Parent { ignored: None }
        );
    }

    #[test]
    fn an_explicit_np_in_a_batch_script_starts_the_ranks() {
        // sbatch: SLURM_PROCID=0 and SLURM_NTASKS are set, but srun started nothing.
        for np in [2, 4] {
            let r = role_in(Some(np), &SBATCH);
            let w = ignored(&r);
            assert!(
                w.contains("SLURM_PROCID=0") && w.contains("SLURM_NTASKS=4"),
                "{w}"
            );
            assert!(
                w.contains("batch script") && w.contains(&format!("--np {np}")),
                "{w}"
            );
        }
        // Without --np it stays a rank, but says why it may wait for peers.
        match role_in(None, &SBATCH) {
            Role::Rank { warning: Some(w) } => {
                assert!(w.contains("SLURM_STEP_ID") && w.contains("srun"), "{w}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_np_that_matches_the_launcher_is_a_rank() {
        let mut srun = SBATCH.to_vec();
        srun.push(("SLURM_STEP_ID", "0"));
        assert_eq!(role_in(Some(4), &srun), Role::Rank { warning: None });
        assert_eq!(role_in(None, &srun), Role::Rank { warning: None });
        let oxccl = [
            ("OXCCL_RANK", "1"),
            ("OXCCL_WORLD_SIZE", "2"),
            ("OXCCL_STORE", "127.0.0.1:5"),
        ];
        assert_eq!(role_in(Some(2), &oxccl), Role::Rank { warning: None });
        // The ranks a parent started in a batch script: oxccl's variables come first.
        let mut child = SBATCH.to_vec();
        child.extend([
            ("OXCCL_RANK", "1"),
            ("OXCCL_WORLD_SIZE", "2"),
            ("OXCCL_STORE", "127.0.0.1:5"),
        ]);
        assert_eq!(role_in(Some(2), &child), Role::Rank { warning: None });
    }

    #[test]
    fn an_np_that_contradicts_the_launcher_wins_with_a_warning() {
        let mut srun = SBATCH.to_vec();
        srun.push(("SLURM_STEP_ID", "0"));
        let w = ignored(&role_in(Some(2), &srun)).to_owned();
        assert!(w.contains("job of 4 ranks, not 2"), "{w}");
        let torch = [("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "h")];
        let r = role_in(
            Some(3),
            &[torch[0], torch[1], torch[2], ("MASTER_PORT", "9")],
        );
        assert!(ignored(&r).contains("RANK=0, WORLD_SIZE=1"), "{r:?}");
        // RANK without WORLD_SIZE is no whole job.
        let r = role_in(Some(2), &[("RANK", "0")]);
        assert!(ignored(&r).contains("do not describe a whole job"), "{r:?}");
    }
}
