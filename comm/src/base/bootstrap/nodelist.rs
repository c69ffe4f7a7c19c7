//! Expansion of Slurm's compressed host lists (`SLURM_NODELIST`, `SLURM_STEP_NODELIST`) and
//! task-count lists (`SLURM_TASKS_PER_NODE`).

use crate::base::error::{Error, Result};

/// Refuse to expand lists longer than this (guards against `node[0-999999999]`).
const MAX_HOSTS: usize = 1 << 20;

fn malformed(s: &str, why: impl std::fmt::Display) -> Error {
    Error::Config(format!("malformed Slurm node list '{s}': {why}"))
}

/// Expands a Slurm compressed host list into host names, in order.
///
/// `"node[01-03,07],gpu5"` gives `node01, node02, node03, node07, gpu5`: zero padding (the
/// width of a range's lower bound) is kept, items are separated by top-level commas, and an
/// item may hold several bracket groups (`r[1-2]n[1-2]` gives `r1n1, r1n2, r2n1, r2n2`).
/// An empty (or all-blank) string gives an empty list.
///
/// # Errors
/// [`Error::Config`] for malformed input: unbalanced or nested brackets, empty items or ranges,
/// non-numeric or reversed ranges (`node[3-1]`), or more than 2^20 hosts.
pub fn expand_nodelist(s: &str) -> Result<Vec<String>> {
    let s = s.trim();
    let mut out = Vec::new();
    if s.is_empty() {
        return Ok(out);
    }
    for item in split_top_level(s)? {
        if item.is_empty() {
            return Err(malformed(s, "empty host name"));
        }
        for host in expand_item(s, item)? {
            if out.len() >= MAX_HOSTS {
                return Err(malformed(s, format!("more than {MAX_HOSTS} hosts")));
            }
            out.push(host);
        }
    }
    Ok(out)
}

/// Splits at commas outside brackets, checking that brackets balance and do not nest.
fn split_top_level(s: &str) -> Result<Vec<&str>> {
    let mut items = Vec::new();
    let mut depth = 0;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match c {
            '[' if depth == 0 => depth = 1,
            '[' => return Err(malformed(s, format!("nested '[' at offset {i}"))),
            ']' if depth == 1 => depth = 0,
            ']' => return Err(malformed(s, format!("unmatched ']' at offset {i}"))),
            ',' if depth == 0 => {
                items.push(s[start..i].trim());
                start = i + 1;
            }
            c if c.is_whitespace() && depth == 1 => {
                return Err(malformed(s, "whitespace inside brackets"))
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(malformed(s, "unclosed '['"));
    }
    items.push(s[start..].trim());
    Ok(items)
}

/// Expands one item (brackets already known to balance). Iterative, so an item with any number
/// of bracket groups (`a[1]a[1]...`) cannot exhaust the stack.
fn expand_item(s: &str, item: &str) -> Result<Vec<String>> {
    // The item as literal text and bracket groups: `lits[0] g[0] lits[1] g[1] ... lits[n]`.
    let mut lits: Vec<&str> = Vec::new();
    let mut groups: Vec<Vec<String>> = Vec::new();
    let mut total: usize = 1;
    let mut rest = item;
    while let Some(open) = rest.find('[') {
        let close = open
            + rest[open..]
                .find(']')
                .ok_or_else(|| malformed(s, "unclosed '['"))?;
        lits.push(&rest[..open]);
        let values = expand_ranges(s, &rest[open + 1..close])?;
        total = total.saturating_mul(values.len());
        if total > MAX_HOSTS {
            return Err(malformed(s, format!("more than {MAX_HOSTS} hosts")));
        }
        groups.push(values);
        rest = &rest[close + 1..];
    }
    lits.push(rest);
    // Every combination, the first group varying slowest (an odometer over the groups).
    let mut out = Vec::with_capacity(total);
    let mut idx = vec![0usize; groups.len()];
    loop {
        let mut host = String::from(lits[0]);
        for (g, &i) in idx.iter().enumerate() {
            host.push_str(&groups[g][i]);
            host.push_str(lits[g + 1]);
        }
        out.push(host);
        // Advance the odometer from the last group; done when every digit wrapped.
        let mut g = groups.len();
        loop {
            if g == 0 {
                return Ok(out);
            }
            g -= 1;
            idx[g] += 1;
            if idx[g] < groups[g].len() {
                break;
            }
            idx[g] = 0;
        }
    }
}

/// Expands the inside of one bracket group, e.g. `01-03,07`.
fn expand_ranges(s: &str, inner: &str) -> Result<Vec<String>> {
    let number = |t: &str| -> Result<u64> {
        if t.is_empty() || t.len() > 18 || !t.bytes().all(|b| b.is_ascii_digit()) {
            return Err(malformed(s, format!("'{t}' is not a valid range bound")));
        }
        t.parse::<u64>()
            .map_err(|_| malformed(s, format!("'{t}' is not a valid range bound")))
    };
    let mut out = Vec::new();
    for part in inner.split(',') {
        match part.split_once('-') {
            None => {
                number(part)?;
                out.push(part.to_owned());
            }
            Some((lo_s, hi_s)) => {
                let (lo, hi) = (number(lo_s)?, number(hi_s)?);
                if lo > hi {
                    return Err(malformed(s, format!("reversed range '{part}'")));
                }
                if hi - lo >= MAX_HOSTS as u64 {
                    return Err(malformed(s, format!("range '{part}' has too many hosts")));
                }
                let width = lo_s.len();
                out.extend((lo..=hi).map(|v| format!("{v:0width$}")));
            }
        }
        if out.len() > MAX_HOSTS {
            return Err(malformed(s, format!("more than {MAX_HOSTS} hosts")));
        }
    }
    Ok(out)
}

/// Expands `SLURM_TASKS_PER_NODE` (`"2(x3),1"` gives `[2, 2, 2, 1]`).
///
/// # Errors
/// [`Error::Config`] naming the variable and value when the format is not understood.
pub fn expand_tasks_per_node(s: &str) -> Result<Vec<usize>> {
    expand_tasks_per_node_of("SLURM_TASKS_PER_NODE", s)
}

/// [`expand_tasks_per_node`] of the value `s` of variable `name` (named in errors).
pub(crate) fn expand_tasks_per_node_of(name: &str, s: &str) -> Result<Vec<usize>> {
    let bad = |why: &str| Error::Config(format!("{name}='{s}' is malformed: {why}"));
    let mut out = Vec::new();
    for item in s.trim().split(',') {
        let item = item.trim();
        let (count, reps) = match item.split_once('(') {
            None => (item, "1"),
            Some((c, rest)) => {
                let reps = rest
                    .strip_prefix('x')
                    .and_then(|r| r.strip_suffix(')'))
                    .ok_or_else(|| bad("expected 'N(xM)'"))?;
                (c, reps)
            }
        };
        let count: usize = count
            .parse()
            .map_err(|_| bad(&format!("'{count}' is not a task count")))?;
        let reps: usize = reps
            .parse()
            .map_err(|_| bad(&format!("'{reps}' is not a repeat count")))?;
        if out.len().saturating_add(reps) > MAX_HOSTS {
            return Err(bad("too many nodes"));
        }
        out.extend(std::iter::repeat_n(count, reps));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_and_padding() {
        assert_eq!(
            expand_nodelist("node[01-03,07]").unwrap(),
            ["node01", "node02", "node03", "node07"]
        );
        assert_eq!(
            expand_nodelist("n[8-11]").unwrap(),
            ["n8", "n9", "n10", "n11"]
        );
        assert_eq!(
            expand_nodelist("n[098-101]").unwrap(),
            ["n098", "n099", "n100", "n101"]
        );
    }

    #[test]
    fn several_groups_and_many_groups() {
        assert_eq!(
            expand_nodelist("r[1-2]n[1-2]x,a").unwrap(),
            ["r1n1x", "r1n2x", "r2n1x", "r2n2x", "a"]
        );
        // 40 KB of bracket groups: no stack overflow (the recursive expansion overflowed).
        let long = "a[1]".repeat(10_000);
        let hosts = expand_nodelist(&long).unwrap();
        assert_eq!(hosts, ["a1".repeat(10_000)]);
        let long = format!("{}[", "a[1]".repeat(10_000));
        assert!(expand_nodelist(&long).is_err());
        assert!(expand_nodelist("n[1-1024][1-1024][1-2]").is_err());
    }

    #[test]
    fn tasks_per_node() {
        assert_eq!(expand_tasks_per_node("2(x3),1").unwrap(), [2, 2, 2, 1]);
        assert_eq!(expand_tasks_per_node("4").unwrap(), [4]);
        assert!(expand_tasks_per_node("2(3)").is_err());
        assert!(expand_tasks_per_node("x").is_err());
    }
}
