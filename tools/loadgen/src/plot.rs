//! Charts written as SVG by hand: panels with rounded ticks, grid lines, labelled axes and a
//! legend; lines over seconds or bars over named groups. No plotting stack to install.

use std::fmt::Write;

/// A value axis from zero: its top and the step between ticks, both "round" (1, 2 or 5 times a
/// power of ten), with at most [`TICKS_MAX`] steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Axis {
    pub top: f64,
    pub step: f64,
}

const TICKS_MAX: f64 = 6.0;

impl Axis {
    /// The smallest round axis that holds `max` (an empty or non-finite series: 0 to 1).
    pub fn holding(max: f64) -> Axis {
        if !max.is_finite() || max <= 0.0 {
            return Axis {
                top: 1.0,
                step: 0.2,
            };
        }
        let raw = max / TICKS_MAX;
        let power = 10f64.powf(raw.log10().floor());
        let step = [1.0, 2.0, 5.0, 10.0]
            .into_iter()
            .map(|m| m * power)
            .find(|&s| s >= raw)
            .unwrap_or(10.0 * power);
        // Less a hair, so that a maximum on a tick (in floating point, a hair above it) is
        // its top.
        Axis {
            top: (max / step - 1e-9).ceil() * step,
            step,
        }
    }

    /// The tick values from zero to the top.
    pub fn ticks(&self) -> impl Iterator<Item = f64> + '_ {
        let n = (self.top / self.step).round() as usize;
        (0..=n).map(move |i| i as f64 * self.step)
    }
}

/// A tick's label: no more decimals than the step needs, thousands as "k".
fn tick_label(v: f64, step: f64) -> String {
    if v >= 1000.0 && step >= 100.0 {
        let k = v / 1000.0;
        return if (k - k.round()).abs() < 1e-9 {
            format!("{k:.0}k")
        } else {
            format!("{k:.1}k")
        };
    }
    let decimals = if step >= 1.0 {
        0
    } else {
        (-step.log10() - 1e-9).ceil() as usize
    };
    format!("{v:.decimals$}")
}

/// Text for an SVG text node or attribute.
fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A picture's width, and the left and right of its panels (the left holds the tick labels).
const WIDTH: f64 = 860.0;
const LEFT: f64 = 64.0;
const RIGHT: f64 = 24.0;
/// A panel's plotting height, and the room above it (title, legend) and below it (the x axis).
pub const PANEL: f64 = 200.0;
const ABOVE: f64 = 44.0;
const BELOW: f64 = 44.0;

/// Where panel `i` (from the top) of a [`Svg::stacked`] picture plots.
pub fn panel(i: usize) -> Area {
    Area {
        left: LEFT,
        top: 8.0 + ABOVE + (ABOVE + PANEL + BELOW) * i as f64,
        width: WIDTH - LEFT - RIGHT,
        height: PANEL,
    }
}

/// The largest number in `values` (0 when there is none): where an axis must reach.
fn largest(values: impl Iterator<Item = f64>) -> f64 {
    values.filter(|v| v.is_finite()).fold(0.0, f64::max)
}

/// A picture being drawn: the elements in order.
pub struct Svg {
    width: f64,
    height: f64,
    body: String,
}

/// Where a panel's plotting area is, in the picture.
#[derive(Debug, Clone, Copy)]
pub struct Area {
    pub left: f64,
    pub top: f64,
    pub width: f64,
    pub height: f64,
}

impl Area {
    fn bottom(&self) -> f64 {
        self.top + self.height
    }
    fn right(&self) -> f64 {
        self.left + self.width
    }
    /// The height in the picture of `v` on `axis`.
    fn y(&self, v: f64, axis: Axis) -> f64 {
        self.bottom() - self.height * (v / axis.top).clamp(0.0, 1.0)
    }
}

/// A dashed line across a line chart, with its label.
#[derive(Debug, Clone, Copy)]
pub enum Mark<'a> {
    /// Upright, at a second (e.g. where the sending stopped).
    At(f64, &'a str),
    /// Level, at a value (e.g. a limit); the axis holds it.
    Level(f64, &'a str),
}

/// One named series and its colour. In a line, a value that is not a number (NaN) is a gap:
/// nothing is drawn there, rather than a value the series did not have.
pub struct Series<'a> {
    pub name: &'a str,
    pub color: &'a str,
    pub values: Vec<f64>,
}

impl Svg {
    /// A picture of `n` panels one above the other, [`panel`] `0` to `n - 1`.
    pub fn stacked(n: usize) -> Svg {
        Svg::new(WIDTH, 8.0 + (ABOVE + PANEL + BELOW) * n as f64)
    }

    fn new(width: f64, height: f64) -> Svg {
        Svg {
            width,
            height,
            body: String::new(),
        }
    }

    fn push(&mut self, element: std::fmt::Arguments<'_>) {
        self.body.write_fmt(element).expect("write to string");
        self.body.push('\n');
    }

    /// Text at (x, y); `anchor` is start, middle or end.
    pub fn text(&mut self, x: f64, y: f64, anchor: &str, size: f64, text: &str) {
        self.push(format_args!(
            r#"<text x="{x:.1}" y="{y:.1}" text-anchor="{anchor}" font-size="{size}">{}</text>"#,
            escape(text)
        ));
    }

    fn line(&mut self, (x1, y1): (f64, f64), (x2, y2): (f64, f64), style: &str) {
        self.push(format_args!(
            r#"<line x1="{x1:.1}" y1="{y1:.1}" x2="{x2:.1}" y2="{y2:.1}" {style}/>"#
        ));
    }

    fn rect(&mut self, x: f64, y: f64, w: f64, h: f64, color: &str) {
        self.push(format_args!(
            r#"<rect x="{x:.1}" y="{y:.1}" width="{w:.1}" height="{h:.1}" fill="{color}"/>"#
        ));
    }

    /// The panel's title, its value axis (grid lines and tick labels, the unit beside them) and
    /// its legend; returns the axis.
    fn frame(&mut self, area: Area, title: &str, unit: &str, max: f64, series: &[Series]) -> Axis {
        let axis = Axis::holding(max);
        self.text(area.left, area.top - 22.0, "start", 13.0, title);
        for v in axis.ticks() {
            let y = area.y(v, axis);
            let style = if v == 0.0 {
                r##"stroke="#666""##
            } else {
                r##"stroke="#e4e4e4""##
            };
            self.line((area.left, y), (area.right(), y), style);
            self.text(
                area.left - 6.0,
                y + 4.0,
                "end",
                11.0,
                &tick_label(v, axis.step),
            );
        }
        self.text(area.left - 6.0, area.top - 8.0, "end", 11.0, unit);
        let mut x = area.right();
        for s in series.iter().rev() {
            let w = 7.0 * s.name.chars().count() as f64 + 24.0;
            x -= w;
            self.rect(x, area.top - 28.0, 12.0, 4.0, s.color);
            self.text(x + 16.0, area.top - 22.0, "start", 11.0, s.name);
        }
        axis
    }

    /// Lines over seconds `0..n` (the longest series), the x axis ticked in round seconds, and
    /// the `marks` dashed across them.
    pub fn lines(
        &mut self,
        area: Area,
        title: &str,
        unit: &str,
        series: &[Series],
        marks: &[Mark],
    ) {
        let n = series.iter().map(|s| s.values.len()).max().unwrap_or(0);
        let xs: Vec<f64> = (0..n.max(2)).map(|i| i as f64).collect();
        self.curves(
            area,
            title,
            unit,
            (&xs, "seconds since the start"),
            series,
            marks,
        );
    }

    /// Lines through the points (`xs[i]`, each series' `values[i]`), the x axis from zero to the
    /// largest x, ticked round and named `x_label`, and the `marks` dashed across them.
    pub fn curves(
        &mut self,
        area: Area,
        title: &str,
        unit: &str,
        (xs, x_label): (&[f64], &str),
        series: &[Series],
        marks: &[Mark],
    ) {
        let levels = marks.iter().filter_map(|m| match m {
            Mark::Level(v, _) => Some(*v),
            Mark::At(..) => None,
        });
        let max = largest(
            series
                .iter()
                .flat_map(|s| s.values.iter().copied())
                .chain(levels),
        );
        let axis = self.frame(area, title, unit, max, series);
        let span = largest(xs.iter().copied()).max(1e-9);
        let x = |v: f64| area.left + area.width * v / span;
        let ticks = Axis::holding(span);
        for t in ticks.ticks().filter(|&t| t <= span * (1.0 + 1e-9)) {
            self.line(
                (x(t), area.bottom()),
                (x(t), area.bottom() + 4.0),
                r##"stroke="#666""##,
            );
            self.text(
                x(t),
                area.bottom() + 16.0,
                "middle",
                11.0,
                &tick_label(t, ticks.step),
            );
        }
        self.text(area.right(), area.bottom() + 30.0, "end", 11.0, x_label);
        let dashed = r##"stroke="#888" stroke-dasharray="4 3""##;
        for mark in marks {
            match *mark {
                Mark::At(at, label) if (0.0..=span).contains(&at) => {
                    self.line((x(at), area.top), (x(at), area.bottom()), dashed);
                    self.text(x(at) + 4.0, area.top + 12.0, "start", 11.0, label);
                }
                Mark::At(..) => {}
                Mark::Level(v, label) => {
                    let y = area.y(v, axis);
                    self.line((area.left, y), (area.right(), y), dashed);
                    self.text(area.right(), y - 4.0, "end", 11.0, label);
                }
            }
        }
        for s in series {
            let points: Vec<Option<String>> = s
                .values
                .iter()
                .zip(xs)
                .map(|(&v, &at)| {
                    v.is_finite()
                        .then(|| format!("{:.1},{:.1}", x(at), area.y(v, axis)))
                })
                .collect();
            for run in points.split(Option::is_none).filter(|r| !r.is_empty()) {
                let run: Vec<&str> = run.iter().flatten().map(String::as_str).collect();
                self.push(format_args!(
                    r#"<polyline fill="none" stroke="{}" stroke-width="2" points="{}"/>"#,
                    s.color,
                    run.join(" ")
                ));
            }
        }
    }

    /// Bars side by side for each group, the groups named under the axis; with room, each bar
    /// carries its value (`value` formats it).
    pub fn bars(
        &mut self,
        area: Area,
        title: &str,
        unit: &str,
        groups: &[String],
        series: &[Series],
        value: impl Fn(f64) -> String,
    ) {
        let max = largest(series.iter().flat_map(|s| s.values.iter().copied()));
        let axis = self.frame(area, title, unit, max, series);
        let slot = area.width / groups.len().max(1) as f64;
        let bar = slot * 0.8 / series.len().max(1) as f64;
        let labelled = bar >= 26.0;
        for (g, name) in groups.iter().enumerate() {
            let x0 = area.left + slot * g as f64 + slot * 0.1;
            for (k, s) in series.iter().enumerate() {
                let v = s.values.get(g).copied().unwrap_or(0.0);
                let (x, y) = (x0 + bar * k as f64, area.y(v, axis));
                self.rect(x, y, bar * 0.92, area.bottom() - y, s.color);
                if labelled {
                    self.text(x + bar * 0.46, y - 3.0, "middle", 10.0, &value(v));
                }
            }
            self.text(
                area.left + slot * (g as f64 + 0.5),
                area.bottom() + 15.0,
                "middle",
                11.0,
                name,
            );
        }
    }

    pub fn finish(self) -> String {
        format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" \
             viewBox=\"0 0 {w} {h}\" font-family=\"sans-serif\">\n\
             <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n{}</svg>\n",
            self.body,
            w = self.width,
            h = self.height,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_axis_is_round_holds_its_maximum_and_has_few_ticks() {
        let near = |a: f64, b: f64| (a - b).abs() <= b.abs() * 1e-9;
        for (max, top, step) in [
            (239.0, 250.0, 50.0),
            (19_151.0, 20_000.0, 5_000.0),
            (1.0, 1.0, 0.2),
            (0.893, 1.0, 0.2),
            (6.0, 6.0, 1.0),
            (45_000.0, 50_000.0, 10_000.0),
            (0.0, 1.0, 0.2),
            (f64::NAN, 1.0, 0.2),
        ] {
            let a = Axis::holding(max);
            assert!(near(a.top, top) && near(a.step, step), "for {max}: {a:?}");
        }
        for max in [0.013, 3.7, 99.9, 101.0, 7_777.0, 1.0e9] {
            let a = Axis::holding(max);
            let ticks: Vec<f64> = a.ticks().collect();
            assert!(a.top >= max && a.top - a.step < max, "{max}: {a:?}");
            assert!(ticks.len() <= TICKS_MAX as usize + 1, "{max}: {ticks:?}");
            assert_eq!(ticks[0], 0.0);
            assert!(
                (ticks[ticks.len() - 1] - a.top).abs() < a.step * 1e-9,
                "{ticks:?}"
            );
        }
    }

    #[test]
    fn tick_labels_carry_the_decimals_their_step_needs() {
        assert_eq!(tick_label(0.4, 0.2), "0.4");
        assert_eq!(tick_label(0.4, Axis::holding(0.55).step), "0.4");
        assert_eq!(tick_label(0.05, 0.01), "0.05");
        assert_eq!(tick_label(250.0, 50.0), "250");
        assert_eq!(tick_label(20_000.0, 5_000.0), "20k");
        assert_eq!(tick_label(2_500.0, 500.0), "2.5k");
    }

    #[test]
    fn text_is_escaped() {
        let mut svg = Svg::new(10.0, 10.0);
        svg.text(0.0, 0.0, "start", 11.0, "a < b & \"c\"");
        let out = svg.finish();
        assert!(out.contains("a &lt; b &amp; &quot;c&quot;"), "{out}");
    }
}
