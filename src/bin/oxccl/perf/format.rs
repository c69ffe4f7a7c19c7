//! The nccl-tests text format: header, rows, footer; and the result types behind them.

use serde::Serialize;

/// One measured placement (out of place or in place) of one row.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Measure {
    /// Time per call in microseconds, combined over ranks per `-a`.
    pub time_us: f64,
    /// Algorithm bandwidth, GB/s (1e9 B/s): size / time.
    pub algbw: f64,
    /// Bus bandwidth, GB/s: algbw x the collective's factor.
    pub busbw: f64,
    /// Wrong elements summed over ranks; `None` when checking is off.
    pub wrong: Option<u64>,
}

impl Measure {
    /// Bandwidths of `bytes` moved in `secs` seconds per call, with bus factor `factor`.
    pub fn new(bytes: usize, secs: f64, factor: f64, wrong: Option<u64>) -> Measure {
        let algbw = if secs > 0.0 {
            bytes as f64 / 1e9 / secs
        } else {
            0.0
        };
        Measure {
            time_us: secs * 1e6,
            algbw,
            busbw: algbw * factor,
            wrong,
        }
    }
}

/// One line of the table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Row {
    /// Sweep repetition (`-N`), from 0.
    pub cycle: u32,
    /// Collective name (`all-reduce`, ...).
    pub collective: String,
    /// nccl-tests type name (`float`, ...).
    pub dtype: String,
    /// Reduction name, `none` for collectives without one.
    pub redop: String,
    /// Root rank, -1 for collectives without one.
    pub root: i64,
    /// Full buffer in bytes (nccl-tests' `size`).
    pub size: usize,
    /// Element count as called (nccl-tests' `count`).
    pub count: usize,
    /// Out-of-place result.
    pub out_of_place: Measure,
    /// In-place result, `None` where oxccl has no in-place form.
    pub in_place: Option<Measure>,
}

/// nccl-tests' time column: 2 decimals below 100 us, 1 below 10 ms, none above.
pub fn time_str(us: f64) -> String {
    if us >= 10000.0 {
        format!("{us:7.0}")
    } else if us >= 100.0 {
        format!("{us:7.1}")
    } else {
        format!("{us:7.2}")
    }
}

/// The three header lines (placement line, names, units), trailing blanks trimmed.
pub fn header() -> [String; 3] {
    let meta = format!(
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}           out-of-place                       in-place",
        "", "", "", "", ""
    );
    let names = format!(
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6} {:>6}  {:>7}  {:>6}  {:>6} {:>6}",
        "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time",
        "algbw", "busbw", "#wrong"
    );
    let units = format!(
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>5}  {:>7}  {:>6}  {:>6}  {:>5}",
        "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)",
        "(GB/s)", ""
    );
    [meta, names, units].map(|s| s.trim_end().to_owned())
}

fn measure_cols(m: Option<&Measure>) -> String {
    match m {
        Some(m) => {
            let wrong = m.wrong.map_or_else(|| "N/A".to_owned(), |w| w.to_string());
            format!(
                "  {}  {:6.2}  {:6.2}  {:>5}",
                time_str(m.time_us),
                m.algbw,
                m.busbw,
                wrong
            )
        }
        None => format!("  {:>7}  {:>6}  {:>6}  {:>5}", "N/A", "N/A", "N/A", "N/A"),
    }
}

/// One table line, nccl-tests widths: `%12li  %12li  %8s  %6s  %6i` then per placement
/// `  %7s  %6.2f  %6.2f  %5li`.
pub fn row_line(r: &Row) -> String {
    format!(
        "{:>12}  {:>12}  {:>8}  {:>6}  {:>6}{}{}",
        r.size,
        r.count,
        r.dtype,
        r.redop,
        r.root,
        measure_cols(Some(&r.out_of_place)),
        measure_cols(r.in_place.as_ref())
    )
}

/// C's `%g`: 6 significant digits, trailing zeros removed, exponent form outside 1e-4..1e6.
pub fn fmt_g(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return format!("{v}");
    }
    let exp = v.abs().log10().floor() as i32;
    if !(-4..6).contains(&exp) {
        let s = format!("{v:.5e}");
        let (mant, e) = s.split_once('e').unwrap_or((&s, "0"));
        let mant = trim_zeros(mant);
        let e: i32 = e.parse().unwrap_or(0);
        let sign = if e < 0 { '-' } else { '+' };
        return format!("{mant}e{sign}{:02}", e.abs());
    }
    let decimals = (5 - exp).max(0) as usize;
    trim_zeros(&format!("{v:.decimals$}")).to_owned()
}

fn trim_zeros(s: &str) -> &str {
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.')
    } else {
        s
    }
}

/// Totals for the footer: failed checks and the average bus bandwidth.
#[derive(Debug, Default, Clone, Copy)]
pub struct Totals {
    /// Checks (row x placement) with at least one wrong element.
    pub failed: u64,
    /// Sum of busbw over measured placements.
    pub busbw_sum: f64,
    /// Number of measured placements.
    pub measured: u64,
}

impl Totals {
    /// Accounts for one row.
    pub fn add(&mut self, r: &Row) {
        for m in std::iter::once(&r.out_of_place).chain(r.in_place.as_ref()) {
            self.busbw_sum += m.busbw;
            self.measured += 1;
            if m.wrong.is_some_and(|w| w > 0) {
                self.failed += 1;
            }
        }
    }

    /// The average bus bandwidth (0 when nothing was measured).
    pub fn avg_busbw(&self) -> f64 {
        if self.measured == 0 {
            0.0
        } else {
            self.busbw_sum / self.measured as f64
        }
    }

    /// The footer lines as nccl-tests prints them (the last one empty).
    pub fn footer(&self) -> [String; 4] {
        [
            format!(
                "# Out of bounds values : {} {}",
                self.failed,
                if self.failed > 0 { "FAILED" } else { "OK" }
            ),
            format!("# Avg bus bandwidth    : {}", fmt_g(self.avg_busbw())),
            "#".to_owned(),
            String::new(),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_matches_nccl_tests() {
        let [meta, names, units] = header();
        assert!(
            meta.starts_with("#  ") && meta.contains("out-of-place") && meta.ends_with("in-place")
        );
        assert_eq!(
            names,
            "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong"
        );
        assert_eq!(
            units,
            "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)"
        );
    }

    fn row(in_place: bool, wrong: Option<u64>) -> Row {
        let m = Measure::new(1 << 20, 250e-6, 1.0, wrong);
        Row {
            cycle: 0,
            collective: "all-reduce".into(),
            dtype: "float".into(),
            redop: "sum".into(),
            root: -1,
            size: 1 << 20,
            count: 1 << 18,
            out_of_place: m,
            in_place: in_place.then_some(m),
        }
    }

    #[test]
    fn rows_have_nccl_tests_widths() {
        let line = row_line(&row(true, Some(0)));
        assert_eq!(
            line,
            "     1048576        262144     float     sum      -1    250.0    4.19    4.19      0    250.0    4.19    4.19      0"
        );
        let line = row_line(&row(false, None));
        assert_eq!(
            line,
            "     1048576        262144     float     sum      -1    250.0    4.19    4.19    N/A      N/A     N/A     N/A    N/A"
        );
        // Columns line up with the header: every row is as wide as the names line.
        assert_eq!(line.len(), header()[1].len());
        assert_eq!(time_str(4.256), "   4.26");
        assert_eq!(time_str(123.45), "  123.5");
        assert_eq!(time_str(12345.6), "  12346");
    }

    #[test]
    fn footer_and_g_format() {
        let mut t = Totals::default();
        t.add(&row(true, Some(0)));
        let mut bad = row(false, Some(3));
        bad.out_of_place.busbw = 1.0;
        t.add(&bad);
        let f = t.footer();
        assert_eq!(f[0], "# Out of bounds values : 1 FAILED");
        assert!(f[1].starts_with("# Avg bus bandwidth    : 3.1"), "{}", f[1]);
        assert_eq!(fmt_g(1.5), "1.5");
        assert_eq!(fmt_g(4.194304), "4.1943");
        assert_eq!(fmt_g(0.0), "0");
        assert_eq!(fmt_g(1234567.0), "1.23457e+06");
        assert_eq!(fmt_g(0.00001234), "1.234e-05");
        assert_eq!(fmt_g(100.0), "100");
    }
}
