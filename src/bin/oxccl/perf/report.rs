//! `--json` (every row plus the run's metadata) and `--plot` (busbw vs size, SVG).

use std::path::Path;

use plotters::prelude::*;
use serde::Serialize;

use super::format::Row;

/// Where the ranks ran.
#[derive(Debug, Clone, Serialize)]
pub struct RankInfo {
    /// Global rank.
    pub rank: usize,
    /// Process id.
    pub pid: u64,
    /// Node id (hostname or `OXCCL_NODE_ID`).
    pub node: String,
    /// Where its buffers live: `host`, or `cuda:<ordinal>`.
    pub device: String,
}

/// The settings of a run, as written to JSON.
#[derive(Debug, Clone, Serialize)]
pub struct Meta {
    /// oxccl version.
    pub oxccl_version: String,
    /// The collective.
    pub collective: String,
    /// Number of ranks.
    pub nranks: usize,
    /// Every rank's pid and node.
    pub ranks: Vec<RankInfo>,
    /// Transport policy (`OXCCL_TRANSPORT`, `auto` when unset).
    pub transport: String,
    /// `OXCCL_ALGO`, if set.
    pub algo: Option<String>,
    /// `-b`.
    pub minbytes: u64,
    /// `-e`.
    pub maxbytes: u64,
    /// `-f` (0 when stepping by bytes).
    pub stepfactor: u64,
    /// `-i` (0 when stepping by a factor).
    pub stepbytes: u64,
    /// `-w`.
    pub warmup_iters: u32,
    /// `-n`.
    pub iters: u32,
    /// `-N`.
    pub run_cycles: u32,
    /// `-c`.
    pub check: bool,
    /// `-z`.
    pub blocking: bool,
    /// `-a` (0 rank 0, 1 mean, 2 min, 3 max).
    pub average: u8,
    /// `-r`.
    pub root: usize,
    /// Bytes of buffers each size cycles through (at least, within 2..=64 sets).
    pub rotate_bytes: usize,
    /// `-R 1`: the host buffers were registered.
    pub registered: bool,
    /// Unix time of the start, seconds.
    pub unix_time: u64,
}

#[derive(Serialize)]
struct Report<'a> {
    meta: &'a Meta,
    rows: &'a [Row],
    out_of_bounds: u64,
    avg_busbw: f64,
}

/// Writes the JSON report.
///
/// # Errors
/// I/O or serialization errors, as text.
pub fn write_json(
    path: &Path,
    meta: &Meta,
    rows: &[Row],
    out_of_bounds: u64,
    avg_busbw: f64,
) -> Result<(), String> {
    let r = Report {
        meta,
        rows,
        out_of_bounds,
        avg_busbw,
    };
    let text = serde_json::to_string_pretty(&r).map_err(|e| e.to_string())?;
    std::fs::write(path, text + "\n").map_err(|e| format!("{}: {e}", path.display()))
}

/// Points of one line: (size in bytes, busbw in GB/s).
type Points = Vec<(f64, f64)>;

/// One line of the plot: a (cycle, dtype, op) run's out-of-place busbw by size.
fn series(rows: &[Row]) -> Vec<(String, Points)> {
    let mut out: Vec<((u32, String, String), Points)> = Vec::new();
    for r in rows.iter().filter(|r| r.size > 0) {
        let key = (r.cycle, r.dtype.clone(), r.redop.clone());
        let p = (r.size as f64, r.out_of_place.busbw);
        match out.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => v.push(p),
            None => out.push((key, vec![p])),
        }
    }
    let cycles = rows.iter().map(|r| r.cycle).max().unwrap_or(0) > 0;
    out.into_iter()
        .map(|((c, d, o), v)| {
            let mut name = if o == "none" { d } else { format!("{d} {o}") };
            if cycles {
                name += &format!(" #{c}");
            }
            (name, v)
        })
        .collect()
}

/// Draws busbw (GB/s) against size (bytes, log2 axis), one line per (dtype, op) run.
///
/// # Errors
/// Drawing or I/O errors, as text.
pub fn write_plot(path: &Path, title: &str, rows: &[Row]) -> Result<(), String> {
    let lines = series(rows);
    let xs = lines.iter().flat_map(|(_, v)| v.iter().map(|p| p.0));
    let (mut lo, mut hi) = xs.fold((f64::MAX, 0.0f64), |(l, h), x| (l.min(x), h.max(x)));
    if lo > hi {
        (lo, hi) = (1.0, 2.0);
    }
    if hi <= lo {
        hi = lo * 2.0;
    }
    let ymax = lines
        .iter()
        .flat_map(|(_, v)| v.iter().map(|p| p.1))
        .fold(0.0f64, f64::max);
    let ymax = if ymax > 0.0 { ymax * 1.1 } else { 1.0 };
    let e = |e: &dyn std::fmt::Display| format!("{}: plot: {e}", path.display());

    let root = SVGBackend::new(path, (1000, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d((lo..hi).log_scale().base(2.0), 0.0..ymax)
        .map_err(|x| e(&x))?;
    chart
        .configure_mesh()
        .x_desc("size (bytes)")
        .y_desc("busbw (GB/s)")
        .x_label_formatter(&|v| human_bytes(*v))
        .draw()
        .map_err(|x| e(&x))?;
    for (i, (name, pts)) in lines.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
            .map_err(|x| e(&x))?
            .label(name.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(|x| e(&x))?;
    }
    if !lines.is_empty() {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|x| e(&x))?;
    }
    root.present().map_err(|x| e(&x))
}

/// `8 B`, `64 KiB`, `1 MiB` (powers of two only get the short form).
pub(super) fn human_bytes(v: f64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = v;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if (v - v.round()).abs() < 1e-9 {
        format!("{} {}", v.round(), units[u])
    } else {
        format!("{v:.1} {}", units[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_labels() {
        assert_eq!(human_bytes(8.0), "8 B");
        assert_eq!(human_bytes(65536.0), "64 KiB");
        assert_eq!(human_bytes(1536.0), "1.5 KiB");
        assert_eq!(human_bytes(64.0 * 1048576.0), "64 MiB");
    }
}
