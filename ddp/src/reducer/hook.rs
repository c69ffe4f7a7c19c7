//! The comm hook: `set_comm_hook`, and the comparison of the hook's name and settings between
//! the ranks before the first bucket that goes through it.

use std::borrow::Borrow;

use oxccl_comm::Communicator;

use super::{Ddp, Phase};
use crate::agree::{differing, fnv1a, fnv1a_str, Setting};
use crate::config::UnevenInputs;
use crate::error::Result;
use crate::hooks::CommHook;

/// Whether the comm hook's settings were compared between the ranks ([`CommHook::settings`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum HookCheck {
    /// Alike on every rank (or the default hook, which has none).
    Agreed,
    /// Not yet: before the next bucket the hook would start.
    Pending,
    /// They differ, as the message says: no bucket goes through the hook.
    Refused(String),
}

impl<C: Borrow<Communicator>> Ddp<C> {
    /// Replaces the comm hook (default [`AllReduceAvg`](crate::AllReduceAvg)).
    ///
    /// # Errors
    /// `InvalidArgument` in the middle of a step, or for a hook that does not average over every
    /// rank ([`CommHook::averages_every_rank`]) with [`UnevenInputs::DivideByActiveRanks`].
    pub fn set_comm_hook(&mut self, hook: impl CommHook + 'static) -> Result<()> {
        if self.phase == Phase::Backward || self.micro != 0 {
            return Err(self.invalid(
                "set_comm_hook",
                "cannot change hooks in the middle of a step",
            ));
        }
        if !hook.averages_every_rank()
            && self.cfg.uneven_inputs == UnevenInputs::DivideByActiveRanks
        {
            return Err(self.invalid(
                "set_comm_hook",
                format!(
                    "hook {} averages over fewer ranks than the communicator's, which \
                     uneven_inputs DivideByActiveRanks cannot rescale; use DivideByWorldSize",
                    hook.name()
                ),
            ));
        }
        self.hook = Box::new(hook);
        self.default_hook = false;
        self.sync_plan = None;
        self.hook_check = HookCheck::Pending;
        Ok(())
    }

    /// Compares the hook's name and settings between the ranks once after `set_comm_hook` (see
    /// [`CommHook::settings`]): one all-reduce of three settings (six words), and when only the
    /// settings' values differ, a second one that names them. Every rank calls it at the same
    /// point (before the first bucket it launches in the step) and gets the same answer; the
    /// error is reported under the call that reports the step's errors.
    pub(super) fn check_hook(&mut self) -> Result<()> {
        let op = self.step_op();
        match &self.hook_check {
            HookCheck::Agreed => return Ok(()),
            HookCheck::Refused(msg) => return Err(self.invalid(op, msg.clone())),
            HookCheck::Pending => {}
        }
        let name = self.hook.name().to_string();
        let pairs = self.hook.settings();
        let settings: Vec<Setting> = pairs.iter().map(|&(n, v)| Setting::number(n, v)).collect();
        let all = fnv1a(pairs.iter().flat_map(|&(n, v)| [fnv1a_str(n), v]));
        let listed: Vec<String> = pairs.iter().map(|(n, v)| format!("{n} {v}")).collect();
        let summary = [
            Setting::described("the comm hook", fnv1a_str(&name), name.clone()),
            Setting::number("the hook's setting count", settings.len() as u64),
            Setting::described(
                "the hook's settings",
                all,
                format!("[{}]", listed.join(", ")),
            ),
        ];
        let c = self.comm.borrow();
        let mut d = differing(c, &summary, &mut [])?;
        if d.len() == 1 && d[0].0 == 2 {
            // The same hook with other values: say which (the summary's word if none by name).
            let named = differing(c, &settings, &mut [])?;
            if !named.is_empty() {
                d = named;
            }
        }
        if d.is_empty() {
            self.hook_check = HookCheck::Agreed;
            return Ok(());
        }
        let msg: Vec<String> = d.into_iter().map(|(_, m)| m).collect();
        let msg = format!(
            "hook {name} (given to set_comm_hook): {}; no bucket goes through it (every step \
             fails) until every rank calls set_comm_hook again with hooks alike",
            msg.join("; ")
        );
        self.hook_check = HookCheck::Refused(msg.clone());
        Err(self.invalid(op, msg))
    }
}
