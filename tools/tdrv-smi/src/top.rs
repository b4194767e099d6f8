//! `tdrv-smi top`: the device list and the process list, refreshed. The
//! busy percentage is measured over the refresh period (the previous
//! frame's busy_ns reading to this one's), so no frame sleeps to sample.

use std::io;
use std::time::{Duration, Instant};

use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Modifier, Style, Stylize};
use ratatui::text::Line;
use ratatui::widgets::{Block, Cell, Paragraph, Row, Table};
use ratatui::Frame;
use tdrv_smi::collect::{self, BusySampler, Paths};
use tdrv_smi::model::{DeviceList, ProcessList, SCHEMA};

use crate::text;

/// One refresh: both lists.
struct Snapshot {
    devices: DeviceList,
    processes: ProcessList,
    taken: std::time::SystemTime,
}

struct State {
    paths: Paths,
    wanted: Vec<String>,
    sampler: BusySampler,
}

impl State {
    /// With `prime`, takes a first busy reading now, for a first frame
    /// drawn one period later; without, the first frame (drawn at once)
    /// shows no busy figure rather than one over a few microseconds.
    fn new(paths: &Paths, wanted: &[String], prime: bool) -> State {
        let mut s = State {
            paths: paths.clone(),
            wanted: wanted.to_vec(),
            sampler: BusySampler::default(),
        };
        if prime {
            if let Ok(found) = collect::discover(&s.paths, &s.wanted) {
                s.sampler.prime(&s.paths, &found);
            }
        }
        s
    }

    fn snapshot(&mut self) -> Snapshot {
        let mut devices = DeviceList {
            schema: SCHEMA,
            devices: Vec::new(),
            errors: Vec::new(),
            warnings: Vec::new(),
        };
        // Devices come and go (edu unbind, rmmod): rediscover every time.
        match collect::discover(&self.paths, &self.wanted) {
            Ok(found) => {
                collect::collect_into(&self.paths, &found, &mut self.sampler, &mut devices)
            }
            Err(p) => devices.errors.push(p),
        }
        // Listed after the devices are probed, when tdrv-smi's own files
        // are closed again, so it never lists itself.
        let processes = collect::processes(&self.paths, &collect::wanted_names(&self.wanted));
        Snapshot {
            devices,
            processes,
            taken: std::time::SystemTime::now(),
        }
    }
}

/// Seconds since the epoch as `HH:MM:SS` UTC (no time zone database in
/// the guest, and no dependency for it).
fn clock(t: std::time::SystemTime) -> String {
    let s = t
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format!("{:02}:{:02}:{:02}", s / 3600 % 24, s / 60 % 60, s % 60)
}

/// `top -b`: text frames, for logs and pipes.
pub fn batch(
    paths: &Paths,
    wanted: &[String],
    delay: Duration,
    iterations: Option<u64>,
) -> io::Result<()> {
    let mut state = State::new(paths, wanted, true);
    let mut n = 0u64;
    loop {
        std::thread::sleep(delay);
        let s = state.snapshot();
        println!("tdrv-smi top at {} UTC", clock(s.taken));
        print!("{}", text::devices(&s.devices.devices));
        println!();
        print!("{}", text::processes(&s.processes.processes));
        for p in &s.devices.errors {
            println!("error: {}", p.message);
        }
        for w in s.devices.warnings.iter().chain(&s.processes.warnings) {
            println!("warning: {w}");
        }
        println!();
        n += 1;
        if iterations.is_some_and(|max| n >= max) {
            return Ok(());
        }
    }
}

/// The full-screen view. The terminal is restored on every exit path,
/// including a panic (ratatui's init installs a hook for that).
pub fn interactive(
    paths: &Paths,
    wanted: &[String],
    delay: Duration,
    iterations: Option<u64>,
) -> io::Result<()> {
    let mut terminal = ratatui::try_init()?;
    let r = run(&mut terminal, paths, wanted, delay, iterations);
    ratatui::try_restore()?;
    r
}

fn run(
    terminal: &mut ratatui::DefaultTerminal,
    paths: &Paths,
    wanted: &[String],
    delay: Duration,
    iterations: Option<u64>,
) -> io::Result<()> {
    let mut state = State::new(paths, wanted, false);
    let mut n = 0u64;
    let mut next = Instant::now() + delay;
    let mut snap = state.snapshot();
    loop {
        terminal.draw(|f| draw(f, &snap, delay))?;
        // Keys are handled as they come; the data refreshes on schedule.
        let timeout = next.saturating_duration_since(Instant::now());
        if event::poll(timeout)? {
            if let Event::Key(k) = event::read()? {
                let ctrl_c =
                    k.code == KeyCode::Char('c') && k.modifiers.contains(KeyModifiers::CONTROL);
                if k.kind == KeyEventKind::Press
                    && (matches!(k.code, KeyCode::Char('q') | KeyCode::Esc) || ctrl_c)
                {
                    return Ok(());
                }
            }
            continue;
        }
        n += 1;
        if iterations.is_some_and(|max| n >= max) {
            return Ok(());
        }
        snap = state.snapshot();
        next = Instant::now() + delay;
    }
}

/// A 10-cell bar and the figure: `█████░░░░░  50.0%`.
fn bar(p: Option<f64>) -> String {
    match p {
        None => "-".into(),
        Some(p) => {
            let full = ((p / 10.0).round() as usize).min(10);
            format!("{}{} {:5.1}%", "█".repeat(full), "░".repeat(10 - full), p)
        }
    }
}

fn draw(f: &mut Frame, s: &Snapshot, delay: Duration) {
    let dev_rows: usize = s
        .devices
        .devices
        .iter()
        .map(|d| d.channels.len().max(1))
        .sum();
    let notes: Vec<String> = s
        .devices
        .errors
        .iter()
        .map(|p| format!("error: {}", p.message))
        .chain(
            s.devices
                .warnings
                .iter()
                .chain(&s.processes.warnings)
                .map(|w| format!("warning: {w}")),
        )
        .collect();
    let [title, devs, procs, foot] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Length(dev_rows as u16 + 3),
        Constraint::Min(4),
        Constraint::Length(notes.len().min(4) as u16),
    ])
    .areas(f.area());

    f.render_widget(
        Paragraph::new(Line::from(vec![
            "tdrv-smi top".bold(),
            format!(
                "  {} UTC  refresh {:.1} s  q: quit",
                clock(s.taken),
                delay.as_secs_f64()
            )
            .into(),
        ])),
        title,
    );

    let mut rows = Vec::new();
    for d in &s.devices.devices {
        let head = [
            d.node.clone(),
            text::opt(d.kind.clone()),
            text::opt(d.abi.map(|a| format!("{}.{}", a.major, a.minor))),
            bar(d.busy_percent),
            text::opt(d.open_files),
            text::opt(d.jobs.as_ref().map(|j| j.completed)),
        ];
        if d.channels.is_empty() {
            let mut r: Vec<String> = head.to_vec();
            r.extend(std::iter::repeat_n("-".to_string(), 5));
            rows.push(Row::new(r));
        }
        for (i, c) in d.channels.iter().enumerate() {
            let mut r: Vec<String> = if i == 0 {
                head.to_vec()
            } else {
                vec![String::new(); head.len()]
            };
            let pct = if c.limit_bytes > 0 {
                c.used_bytes as f64 * 100.0 / c.limit_bytes as f64
            } else {
                0.0
            };
            r.extend([
                format!("hbm{}", c.channel),
                format!(
                    "{} / {} ({pct:.0}%)",
                    text::size(c.used_bytes),
                    text::size(c.limit_bytes)
                ),
                text::size(c.peak_bytes),
                c.buffers.to_string(),
                c.failed_allocs.to_string(),
            ]);
            rows.push(Row::new(r));
        }
    }
    let header = Row::new(
        [
            "DEVICE",
            "KIND",
            "ABI",
            "BUSY",
            "FILES",
            "JOBS",
            "CHAN",
            "USED / LIMIT",
            "PEAK",
            "BUFS",
            "FAILED",
        ]
        .map(Cell::from),
    )
    .style(Style::new().add_modifier(Modifier::BOLD));
    f.render_widget(
        Table::new(
            rows,
            [
                Constraint::Length(12),
                Constraint::Length(5),
                Constraint::Length(4),
                Constraint::Length(17),
                Constraint::Length(5),
                Constraint::Length(7),
                Constraint::Length(5),
                Constraint::Length(26),
                Constraint::Length(10),
                Constraint::Length(5),
                Constraint::Length(6),
            ],
        )
        .header(header)
        .block(Block::bordered().title(" devices ")),
        devs,
    );

    // Heaviest users first, as top does.
    let mut clients = s.processes.processes.clone();
    clients.sort_by(|a, b| b.total_bytes.cmp(&a.total_bytes).then(a.pid.cmp(&b.pid)));
    let channels = clients
        .iter()
        .flat_map(|p| p.channels.iter().map(|c| c.channel + 1))
        .max()
        .unwrap_or(0);
    let mut head: Vec<String> = ["PID", "COMM", "CLIENT", "DEVICE"]
        .map(String::from)
        .to_vec();
    head.extend((0..channels).map(|c| format!("HBM{c}")));
    head.extend(["BUFS", "ENGINE", "QUEUED"].map(String::from));
    let mut widths = vec![
        Constraint::Length(8),
        Constraint::Length(16),
        Constraint::Length(7),
        Constraint::Length(7),
    ];
    widths.extend((0..channels).map(|_| Constraint::Length(11)));
    widths.extend([
        Constraint::Length(5),
        Constraint::Length(10),
        Constraint::Length(6),
    ]);
    let rows: Vec<Row> = clients
        .iter()
        .map(|p| {
            let mut r = vec![
                p.pid.to_string(),
                p.comm.clone(),
                format!("{}{}", p.client_id, if p.shared { "*" } else { "" }),
                p.device.clone(),
            ];
            r.extend((0..channels).map(|ch| {
                p.channels
                    .iter()
                    .find(|c| c.channel == ch)
                    .map_or_else(|| "-".into(), |c| text::size(c.total_bytes))
            }));
            r.push(text::opt(p.buffers));
            r.push(p.engine_copy_ns.map_or_else(|| "-".into(), text::duration));
            r.push(text::opt(p.jobs_queued));
            Row::new(r)
        })
        .collect();
    let title = if clients.is_empty() {
        " processes: none ".to_string()
    } else {
        format!(" processes: {} open files ", clients.len())
    };
    f.render_widget(
        Table::new(rows, widths)
            .header(Row::new(head).style(Style::new().add_modifier(Modifier::BOLD)))
            .block(Block::bordered().title(title)),
        procs,
    );

    f.render_widget(
        Paragraph::new(
            notes
                .iter()
                .take(4)
                .map(|n| Line::from(n.clone()))
                .collect::<Vec<_>>(),
        ),
        foot,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use ratatui::backend::TestBackend;
    use tdrv_smi::model::{Abi, Channel, ClientChannel, Device, ProcessClient};

    /// Renders one frame into an in-memory terminal and returns its text.
    fn render(s: &Snapshot) -> String {
        let mut t = ratatui::Terminal::new(TestBackend::new(120, 20)).unwrap();
        t.draw(|f| draw(f, s, Duration::from_secs(1))).unwrap();
        let buf = t.backend().buffer().clone();
        (0..buf.area.height)
            .map(|y| {
                (0..buf.area.width)
                    .map(|x| buf[(x, y)].symbol().to_string())
                    .collect::<String>()
                    + "\n"
            })
            .collect()
    }

    #[test]
    fn frame_shows_devices_channels_and_clients() {
        let dev = Device {
            node: "/dev/tdrv0".into(),
            name: "tdrv0".into(),
            kind: Some("soft".into()),
            abi: Some(Abi { major: 1, minor: 1 }),
            busy_percent: Some(50.0),
            channels: vec![
                Channel {
                    channel: 0,
                    limit_bytes: 64 << 20,
                    used_bytes: 16 << 20,
                    ..Default::default()
                },
                Channel {
                    channel: 1,
                    limit_bytes: 64 << 20,
                    ..Default::default()
                },
            ],
            ..Default::default()
        };
        let client = ProcessClient {
            pid: 4242,
            comm: "trainer".into(),
            client_id: 7,
            device: "tdrv0".into(),
            fds: vec![3],
            channels: vec![ClientChannel {
                channel: 0,
                total_bytes: 16 << 20,
                resident_bytes: 16 << 20,
            }],
            total_bytes: 16 << 20,
            buffers: Some(1),
            engine_copy_ns: Some(2_000_000),
            jobs_queued: Some(0),
            shared: true,
        };
        let s = Snapshot {
            devices: DeviceList {
                schema: SCHEMA,
                devices: vec![dev],
                errors: vec![],
                warnings: vec!["debugfs missing".into()],
            },
            processes: ProcessList {
                schema: SCHEMA,
                processes: vec![client],
                unreadable_processes: 0,
                errors: vec![],
                warnings: vec![],
            },
            taken: std::time::UNIX_EPOCH,
        };
        let screen = render(&s);
        for want in [
            "tdrv-smi top",
            "00:00:00 UTC",
            "/dev/tdrv0",
            "soft",
            "1.1",
            "█████░░░░░  50.0%",
            "hbm0",
            "hbm1",
            "16.0 MiB / 64.0 MiB (25%)",
            "4242",
            "trainer",
            "7*",
            "2.0 ms",
            "warning: debugfs missing",
        ] {
            assert!(screen.contains(want), "{want:?} not on screen:\n{screen}");
        }
    }
}
