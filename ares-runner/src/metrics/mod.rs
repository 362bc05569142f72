//! Training metrics as JSON lines: one object per optimizer step, appended and flushed as the
//! step ends, so a crashed or interrupted run keeps every finished step.
//!
//! A line looks like `{"step":3,"reward/mean":0.41,"time/rollout":2.5,"kl/mean":null}`:
//! keys are `group/name`, values are numbers, and a value that was not finite (NaN, ±∞) is
//! written as `null` — JSON has no spelling for them, and a gap is more honest than a made-up
//! number. [`Record`] builds a line, [`MetricsWriter`] appends it, [`read_metrics`] reads a
//! file back (naming the line of any malformed record), and [`PhaseTimes`] measures the
//! phases of a step into `time/<phase>` keys.

mod error;
mod reader;
mod record;
mod timing;
mod writer;

pub use error::MetricsError;
pub use reader::read_metrics;
pub(crate) use reader::{NumberedRecord, read_numbered};
pub use record::Record;
pub use timing::{PhaseTimes, Timer};
pub use writer::MetricsWriter;
