//! `tdrv-smi`: lists tdrv devices and the processes using them, and shows
//! both live (`top`). See the crate's README for the JSON format and the
//! exit codes.

mod text;
mod top;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use serde::Serialize;
use tdrv_smi::collect::{self, Paths};
use tdrv_smi::model::{Problem, ProblemKind};

/// Exit codes (also in `--help` and the README).
const EXIT_FAILURE: u8 = 1;
const EXIT_NO_DEVICE: u8 = 3;
const EXIT_PERMISSION: u8 = 4;

#[derive(Parser)]
#[command(
    name = "tdrv-smi",
    version,
    about = "Show tdrv accelerator devices, the processes using them, and a live view",
    after_help = "Exit status: 0 success; 1 a device could not be read for another reason; \
2 usage error; 3 no tdrv device (module not loaded, or no such device); \
4 permission denied (tdrv nodes and debugfs are root-only). \
With --json the document is printed in every case; its \"errors\" say what is missing."
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,

    /// Print JSON for scripts (stable, schema 1; see the README).
    #[arg(long, global = true)]
    json: bool,

    /// Only this device: a node path, tdrv<N> or N. Repeatable.
    #[arg(short = 'd', long = "device", value_name = "DEVICE", global = true)]
    devices: Vec<String>,

    /// Busy percentage sampling interval for the device list, in ms (0: do
    /// not sample; busy_percent is null).
    #[arg(long, value_name = "MS", default_value_t = 200, global = true)]
    interval_ms: u64,

    /// tdrv's debugfs directory.
    #[arg(long, value_name = "DIR", global = true)]
    debugfs: Option<PathBuf>,

    /// Root of the /dev, /proc and /sys trees (tests use a fake tree).
    #[arg(
        long,
        value_name = "DIR",
        default_value = "/",
        global = true,
        hide = true
    )]
    root: PathBuf,
}

#[derive(Subcommand)]
enum Command {
    /// List devices: kind, ABI, channels (used/limit/peak), buffers, failed
    /// allocations, busy % (the default command).
    List,
    /// List processes holding tdrv files, with their per-channel usage
    /// (from /proc/<pid>/fdinfo).
    Ps,
    /// Live view of devices and processes; q or Esc quits.
    Top {
        /// Refresh period in ms.
        #[arg(long, value_name = "MS", default_value_t = 1000)]
        delay_ms: u64,
        /// Plain text frames instead of the full-screen view (the default
        /// when stdout is not a terminal).
        #[arg(short = 'b', long)]
        batch: bool,
        /// Stop after this many refreshes.
        #[arg(short = 'n', long, value_name = "N")]
        iterations: Option<u64>,
    },
    /// Write the CDI spec of the tdrv devices (for podman, containerd and
    /// CRI-O: `--device tdrv.dev/device=all`), or remove it when there is
    /// no device. The package's udev rule runs this on every device added
    /// or removed.
    Cdi {
        /// Where to write the spec; `-` prints it.
        #[arg(short, long, value_name = "PATH", default_value = tdrv_smi::cdi::DEFAULT_OUTPUT)]
        output: PathBuf,
        /// Print nothing on success.
        #[arg(short, long)]
        quiet: bool,
    },
}

/// The exit code for a set of problems: the most specific one wins.
fn exit_for(problems: &[Problem]) -> u8 {
    match problems.iter().map(|p| p.kind).max() {
        None => 0,
        Some(ProblemKind::Permission) => EXIT_PERMISSION,
        Some(ProblemKind::NoDevice) => EXIT_NO_DEVICE,
        Some(ProblemKind::Unbound) | Some(ProblemKind::Io) => EXIT_FAILURE,
    }
}

fn print_json<T: Serialize>(doc: &T) {
    // Serializing plain data into a String cannot fail.
    println!(
        "{}",
        serde_json::to_string_pretty(doc).expect("JSON of plain data")
    );
}

fn report(problems: &[Problem], warnings: &[String]) {
    for w in warnings {
        eprintln!("tdrv-smi: warning: {w}");
    }
    for p in problems {
        eprintln!("tdrv-smi: error: {}", p.message);
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let mut paths = Paths::under(&cli.root);
    if let Some(d) = &cli.debugfs {
        paths.debugfs = d.clone();
    }
    match cli.command.unwrap_or(Command::List) {
        Command::Cdi { output, quiet } => cdi(&paths, &output, quiet),
        Command::List => {
            let list =
                collect::devices(&paths, &cli.devices, Duration::from_millis(cli.interval_ms));
            if cli.json {
                print_json(&list);
            } else {
                print!("{}", text::devices(&list.devices));
            }
            report(&list.errors, &list.warnings);
            ExitCode::from(exit_for(&list.errors))
        }
        Command::Ps => {
            // "No device" is worth saying even here: an empty table would
            // not tell a missing module from an idle one.
            if let Err(p) = collect::discover(&paths, &cli.devices) {
                if cli.json {
                    print_json(&tdrv_smi::model::ProcessList {
                        schema: tdrv_smi::model::SCHEMA,
                        processes: Vec::new(),
                        unreadable_processes: 0,
                        errors: vec![p.clone()],
                        warnings: Vec::new(),
                    });
                }
                report(std::slice::from_ref(&p), &[]);
                return ExitCode::from(exit_for(&[p]));
            }
            let list = collect::processes(&paths, &collect::wanted_names(&cli.devices));
            if cli.json {
                print_json(&list);
            } else {
                print!("{}", text::processes(&list.processes));
            }
            report(&[], &list.warnings);
            ExitCode::SUCCESS
        }
        Command::Top {
            delay_ms,
            batch,
            iterations,
        } => {
            if cli.json {
                eprintln!(
                    "tdrv-smi: error: top has no JSON output; run `tdrv-smi --json` or `tdrv-smi ps --json` repeatedly"
                );
                return ExitCode::from(2);
            }
            if let Err(p) = collect::discover(&paths, &cli.devices) {
                report(std::slice::from_ref(&p), &[]);
                return ExitCode::from(exit_for(&[p]));
            }
            let delay = Duration::from_millis(delay_ms.max(100));
            let batch = batch || !std::io::stdout().is_terminal();
            let r = if batch {
                top::batch(&paths, &cli.devices, delay, iterations)
            } else {
                top::interactive(&paths, &cli.devices, delay, iterations)
            };
            match r {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("tdrv-smi: error: {e}");
                    ExitCode::from(EXIT_FAILURE)
                }
            }
        }
    }
}

/// `tdrv-smi cdi`: see [`Command::Cdi`].
fn cdi(paths: &Paths, output: &std::path::Path, quiet: bool) -> ExitCode {
    use tdrv_smi::cdi::{self, SpecError, Update};
    let warn_missing = |missing: &[String]| {
        for m in missing {
            eprintln!("tdrv-smi: warning: {m} has no node in /dev: left out of the CDI spec");
        }
    };
    if output.as_os_str() == "-" {
        return match cdi::spec(paths) {
            Ok((spec, missing)) => {
                print!("{}", cdi::to_json(&spec));
                warn_missing(&missing);
                ExitCode::SUCCESS
            }
            Err(e @ SpecError::NoDevice) => {
                eprintln!("tdrv-smi: error: {e}: no CDI spec");
                ExitCode::from(EXIT_NO_DEVICE)
            }
            Err(e) => {
                eprintln!("tdrv-smi: error: {e}");
                ExitCode::from(EXIT_FAILURE)
            }
        };
    }
    match cdi::update(paths, output) {
        Ok((Update::Wrote(n), missing)) => {
            warn_missing(&missing);
            if !quiet {
                println!(
                    "{}: {n} tdrv device{} and all ({})",
                    output.display(),
                    if n == 1 { "" } else { "s" },
                    cdi::KIND
                );
            }
            ExitCode::SUCCESS
        }
        Ok((Update::Removed, _)) => {
            if !quiet {
                println!("{}: removed (no tdrv device)", output.display());
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tdrv-smi: error: {e}");
            ExitCode::from(EXIT_FAILURE)
        }
    }
}
