//! Video files (mp4, webm, mkv, mov, …) decoded by the system `ffmpeg`, run as a child process:
//! no codec is linked into ares.
//!
//! # Finding ffmpeg
//!
//! `$ARES_FFMPEG` when set (a path to the executable), else `ffmpeg` on `PATH`
//! ([`Ffmpeg::from_env`]). Without one, decoding a video file fails with
//! [`VisionError::VideoFileNeedsDecoder`], which names the file and says how to get ffmpeg:
//! `apt install ffmpeg`, or `pip install imageio-ffmpeg` and `ARES_FFMPEG` set to the binary it
//! ships (`python -c 'import imageio_ffmpeg; print(imageio_ffmpeg.get_ffmpeg_exe())'`; CI pins
//! imageio-ffmpeg 0.8.1, ffmpeg 9.0.2). Only `ffmpeg` is needed, not `ffprobe` (which
//! imageio-ffmpeg does not ship). ffmpeg 5.1 or newer takes `-fps_mode`; older ones get `-vsync`.
//!
//! # Decoding
//!
//! Two runs of ffmpeg per video, on its first video stream that is not a cover picture
//! (`-map 0:V:0`), never rotated (`-noautorotate`: the coded frames, as PyAV gives them):
//!
//! 1. **Probe and count** ([`probe`]): `ffmpeg -i FILE -f null -` decodes every frame and reports
//!    the count on `-progress pipe:1`; the frame size and rate come from the stream lines ffmpeg
//!    prints on stderr (`Stream #0:0: Video: h264 …, 64x48 …, 29.97 fps, …`). The size is the
//!    decoded one (the output stream's line). The rate is the stream's average frame rate
//!    (PyAV's `average_rate`, which transformers' PyAV loader uses) as ffmpeg prints it, to two
//!    decimals; a printed rate within that rounding of an NTSC rate `N·1000/1001` (23.98, 29.97,
//!    59.94, …) is taken as that rate exactly. The count is the number of decoded frames, which
//!    is what PyAV yields (transformers' PyAV loader reads the container's count instead, the
//!    same for mp4, absent from webm / mkv).
//! 2. **Sample** with [`sample_frame_indices`] (transformers' rule, module
//!    [`processor`](super::processor)). The rate is the file's; `sampling.source_fps` is used
//!    only when the file has none.
//! 3. **Decode the chosen frames** ([`decode_frames`]): a `select` filter keeps the chosen frame
//!    numbers, `-f rawvideo -pix_fmt rgb24 -` streams them on stdout, and only they are read and
//!    kept — memory is the chosen frames, never the whole video, and ffmpeg stops after the last
//!    one (`-frames:v`). Frame timestamps are passed through (`-fps_mode passthrough`): no frame
//!    is duplicated or dropped to make the rate constant, so frame `i` is the `i`-th decoded
//!    frame, as in PyAV.
//! 4. The frames go through the processor's one frame pipeline (resize, normalise, patchify),
//!    as frames read from image files do.
//!
//! # Agreement with PyAV (transformers' default video backend)
//!
//! Measured with ffmpeg 9.0.2 (imageio-ffmpeg 0.8.1) against PyAV 18.1 (its own libav 8.x):
//! lossless RGB video (H.264 `libx264rgb`, VP9 `gbrp`) decodes bit-identically, and so does
//! 8-bit 4:2:0 (H.264, VP9, MPEG-4 Part 2; BT.601 and BT.709, limited and full range) — both run
//! the same swscale YUV → RGB conversion. 10-bit sources do not agree: on an H.264
//! `yuv420p10le` test clip the two `rgb24` conversions differ by up to 127 levels, 9 % of samples
//! by more than 3, and PyAV's is the one further from the source picture. A video whose frame
//! size changes midway is not supported.
//!
//! Cost, on a 60 s 720p H.264 video (1800 frames, 2 cores): the count pass 1.1 s, decoding the
//! 120 frames sampled at 2 fps 1.3 s (PyAV decoding every frame and converting those 120: 1.9 s).
//!
//! # Errors
//!
//! Every error names the file: no ffmpeg ([`VisionError::VideoFileNeedsDecoder`]), ffmpeg failing
//! (not a video, corrupt data, no video stream; with the tail of ffmpeg's stderr), no frames, no
//! frame rate when sampling by rate ([`VisionError::VideoFile`]).

use std::ffi::OsString;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::processor::{
    FRAME_EXTENSIONS, ProcessedVideo, ProcessorConfig, RgbImage, VideoSampling, VisionError,
    frame_files, has_extension, process_chosen, process_video_files, sample_frame_indices,
};

/// The environment variable naming the ffmpeg executable.
pub const FFMPEG_ENV: &str = "ARES_FFMPEG";

pub use super::processor::INSTALL_HINT;

/// Lines of ffmpeg's stderr quoted in errors.
const STDERR_TAIL_LINES: usize = 12;

/// An ffmpeg executable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ffmpeg {
    program: PathBuf,
    from_env: bool,
    /// Longest one ffmpeg run on a video may take before it is killed.
    timeout: Duration,
}

/// How long one ffmpeg run on a video may take (10 min): counting the frames decodes the
/// whole file once, about 1 min for an hour of 720p; a file that keeps ffmpeg running
/// longer is refused rather than waited for.
pub const FFMPEG_TIMEOUT: Duration = Duration::from_secs(600);

/// Kills a child process that still runs when its time is up; stopped (and joined) when
/// the run ends first.
struct Watchdog {
    done: std::sync::mpsc::Sender<()>,
    fired: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

impl Watchdog {
    /// Watches `child` for `limit`.
    fn start(child: Arc<Mutex<Child>>, limit: Duration) -> Self {
        let (done, stop) = std::sync::mpsc::channel::<()>();
        let fired = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&fired);
        let thread = std::thread::spawn(move || {
            if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = stop.recv_timeout(limit) {
                flag.store(true, Ordering::SeqCst);
                if let Ok(mut c) = child.lock() {
                    let _ = c.kill();
                }
            }
        });
        Self {
            done,
            fired,
            thread,
        }
    }

    /// Stops watching; whether the time ran out and the child was killed.
    fn stop(self) -> bool {
        let _ = self.done.send(());
        let _ = self.thread.join();
        self.fired.load(Ordering::SeqCst)
    }
}

/// Waits for a watched child, locking it only to poll, so that the watchdog can still kill
/// a process that closed its pipes but runs on.
fn reap(child: &Mutex<Child>) -> std::io::Result<std::process::ExitStatus> {
    loop {
        let polled = child
            .lock()
            .map_err(|_| std::io::Error::other("ffmpeg's handle was poisoned"))?
            .try_wait()?;
        match polled {
            Some(status) => return Ok(status),
            None => std::thread::sleep(Duration::from_millis(5)),
        }
    }
}

/// Runs `cmd` (stdout and stderr piped, both read whole; stderr's first MiB kept) and waits
/// for it, killing it after `limit`. Returns the output and whether the time ran out.
fn output_within(mut cmd: Command, limit: Duration) -> std::io::Result<(Output, bool)> {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn()?;
    let mut stdout = child.stdout.take();
    let mut stderr = child.stderr.take();
    let out_reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(s) = stdout.as_mut() {
            let _ = s.take(16 << 20).read_to_end(&mut buf);
            let _ = std::io::copy(s, &mut std::io::sink());
        }
        buf
    });
    let err_reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(s) = stderr.as_mut() {
            let _ = s.take(1 << 20).read_to_end(&mut buf);
            let _ = std::io::copy(s, &mut std::io::sink());
        }
        buf
    });
    let child = Arc::new(Mutex::new(child));
    let dog = Watchdog::start(Arc::clone(&child), limit);
    let stdout = out_reader.join().unwrap_or_default();
    let stderr = err_reader.join().unwrap_or_default();
    let status = reap(&child)?;
    let timed_out = dog.stop();
    Ok((
        Output {
            status,
            stdout,
            stderr,
        },
        timed_out,
    ))
}

impl Ffmpeg {
    /// `$ARES_FFMPEG` when set and not empty, else `ffmpeg` (looked up on `PATH` when run).
    pub fn from_env() -> Self {
        Self::locate(std::env::var_os(FFMPEG_ENV))
    }

    /// The executable [`Ffmpeg::from_env`] picks for a given value of `$ARES_FFMPEG`.
    pub fn locate(env_value: Option<OsString>) -> Self {
        match env_value.filter(|v| !v.is_empty()) {
            Some(v) => Ffmpeg {
                program: PathBuf::from(v),
                from_env: true,
                timeout: FFMPEG_TIMEOUT,
            },
            None => Ffmpeg {
                program: PathBuf::from("ffmpeg"),
                from_env: false,
                timeout: FFMPEG_TIMEOUT,
            },
        }
    }

    /// A given executable (a path, or a bare name looked up on `PATH`).
    pub fn at(program: impl Into<PathBuf>) -> Self {
        Ffmpeg {
            program: program.into(),
            from_env: false,
            timeout: FFMPEG_TIMEOUT,
        }
    }

    /// The same ffmpeg with another time limit per run (default [`FFMPEG_TIMEOUT`]).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    fn timed_out(&self, file: &Path, what: &str) -> VisionError {
        file_error(
            file,
            format!(
                "ffmpeg ran past {} s {what} and was stopped (a file that keeps ffmpeg \
                 decoding that long is refused; cut or re-encode it)",
                self.timeout.as_secs_f64()
            ),
        )
    }

    /// The executable run.
    pub fn program(&self) -> &Path {
        &self.program
    }

    /// Where the executable came from, for messages: `ARES_FFMPEG=/x/ffmpeg` or
    /// `ffmpeg on PATH`.
    pub fn describe(&self) -> String {
        if self.from_env {
            format!("{FFMPEG_ENV}={}", self.program.display())
        } else if self.program.components().count() == 1 {
            format!("`{}` on PATH", self.program.display())
        } else {
            self.program.display().to_string()
        }
    }

    /// The first line of `ffmpeg -version` (`ffmpeg version 9.0.2 …`), or why this ffmpeg
    /// cannot be run.
    pub fn version(&self) -> Result<String, String> {
        let out = self
            .command()
            .arg("-version")
            .output()
            .map_err(|e| self.spawn_failure(&e))?;
        let text = String::from_utf8_lossy(&out.stdout);
        let first = text.lines().next().unwrap_or("").trim().to_string();
        if !out.status.success() || !first.starts_with("ffmpeg") {
            return Err(format!(
                "{} does not run as ffmpeg (`-version` exited with {}, printed {first:?})",
                self.describe(),
                out.status
            ));
        }
        Ok(first)
    }

    fn command(&self) -> Command {
        let mut c = Command::new(&self.program);
        c.stdin(Stdio::null());
        c
    }

    fn spawn_failure(&self, e: &std::io::Error) -> String {
        match e.kind() {
            std::io::ErrorKind::NotFound if self.from_env => {
                format!("{} does not exist", self.describe())
            }
            std::io::ErrorKind::NotFound => format!("no {}", self.describe()),
            _ => format!("{} cannot be run: {e}", self.describe()),
        }
    }

    fn spawn_error(&self, file: &Path, e: std::io::Error) -> VisionError {
        VisionError::VideoFileNeedsDecoder {
            file: file.to_path_buf(),
            tried: self.spawn_failure(&e),
        }
    }
}

/// What [`probe`] learns about a video's stream.
#[derive(Debug, Clone, PartialEq)]
pub struct VideoInfo {
    /// Decoded frame height in pixels.
    pub height: usize,
    /// Decoded frame width in pixels.
    pub width: usize,
    /// Average frame rate (frames per second); `None` when the file does not give one.
    pub fps: Option<f64>,
    /// Number of decoded frames.
    pub frames: usize,
    /// The codec as ffmpeg names it (`h264`, `vp9`, …).
    pub codec: String,
}

/// The option passing frame timestamps through: `-fps_mode` (ffmpeg ≥ 5.1; ffmpeg 9 no longer
/// has `-vsync`), else `-vsync` (older).
const FPS_MODE_FLAGS: [&str; 2] = ["-fps_mode", "-vsync"];

/// Whether ffmpeg's stderr says it does not know `flag`.
fn unrecognized(stderr: &[u8], flag: &str) -> bool {
    String::from_utf8_lossy(stderr).contains(&format!("Unrecognized option '{}'", &flag[1..]))
}

fn no_fps_mode(ffmpeg: &Ffmpeg, path: &Path, stderr: &[u8]) -> VisionError {
    file_error(
        path,
        format!(
            "{} takes neither -fps_mode nor -vsync; ffmpeg said:\n{}",
            ffmpeg.describe(),
            stderr_tail(stderr)
        ),
    )
}

/// The `file:` URL ffmpeg is given, so that a name with a colon is not read as a protocol.
fn input_url(path: &Path) -> OsString {
    let mut url = OsString::from("file:");
    url.push(path.as_os_str());
    url
}

/// The last [`STDERR_TAIL_LINES`] non-empty lines of ffmpeg's stderr.
fn stderr_tail(stderr: &[u8]) -> String {
    let text = String::from_utf8_lossy(stderr);
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let tail = &lines[lines.len().saturating_sub(STDERR_TAIL_LINES)..];
    if tail.is_empty() {
        "(ffmpeg printed nothing)".into()
    } else {
        tail.join("\n")
    }
}

fn file_error(file: &Path, message: String) -> VisionError {
    VisionError::VideoFile {
        file: file.to_path_buf(),
        message,
    }
}

/// Decodes every frame of the video once (without converting it) to count frames, and reads the
/// frame size and rate from ffmpeg's stream lines. See the module docs.
pub fn probe(ffmpeg: &Ffmpeg, path: &Path) -> Result<VideoInfo, VisionError> {
    if !path.is_file() {
        return Err(VisionError::Io {
            file: path.to_path_buf(),
            source: std::fs::metadata(path).err().unwrap_or_else(|| {
                std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a file")
            }),
        });
    }
    let mut last_stderr = Vec::new();
    for flag in FPS_MODE_FLAGS {
        let mut cmd = ffmpeg.command();
        cmd.args([
            "-nostdin",
            "-hide_banner",
            "-nostats",
            "-noautorotate",
            "-i",
        ])
        .arg(input_url(path))
        .args(["-map", "0:V:0", flag, "passthrough", "-f", "null", "-"])
        .args(["-progress", "pipe:1"]);
        let (out, timed_out) =
            output_within(cmd, ffmpeg.timeout).map_err(|e| ffmpeg.spawn_error(path, e))?;
        if timed_out {
            return Err(ffmpeg.timed_out(path, "counting the frames"));
        }
        let stderr = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() {
            if unrecognized(&out.stderr, flag) {
                last_stderr = out.stderr;
                continue;
            }
            return Err(file_error(
                path,
                format!(
                    "ffmpeg cannot decode this video ({}; {}); ffmpeg said:\n{}",
                    out.status,
                    ffmpeg.describe(),
                    stderr_tail(&out.stderr)
                ),
            ));
        }
        let progress = String::from_utf8_lossy(&out.stdout);
        let frames = progress
            .lines()
            .filter_map(|l| l.strip_prefix("frame="))
            .filter_map(|v| v.trim().parse::<usize>().ok())
            .next_back();
        let streams = parse_stream_lines(&stderr).ok_or_else(|| {
            file_error(
                path,
                format!(
                    "no video stream line in ffmpeg's output; ffmpeg said:\n{}",
                    stderr_tail(&out.stderr)
                ),
            )
        })?;
        let frames = match frames {
            Some(n) if n > 0 => n,
            _ => {
                return Err(file_error(
                    path,
                    format!(
                        "ffmpeg decoded no frames from the video stream; ffmpeg said:\n{}",
                        stderr_tail(&out.stderr)
                    ),
                ));
            }
        };
        let (height, width) = streams.size.ok_or_else(|| {
            file_error(
                path,
                format!(
                    "no frame size in ffmpeg's stream line {:?}",
                    streams.input_line
                ),
            )
        })?;
        return Ok(VideoInfo {
            height,
            width,
            fps: streams.fps,
            frames,
            codec: streams.codec,
        });
    }
    Err(no_fps_mode(ffmpeg, path, &last_stderr))
}

/// The most bytes of RGB frames one video may decode to (4 GiB: 768 frames of 1280 × 720,
/// transformers' `max_frames` at 720p, need 2 GiB).
pub const MAX_DECODED_VIDEO_BYTES: u64 = 4 << 30;

/// The `select` filter expression keeping frame numbers `indices` (ascending, distinct):
/// `eq(n,i)` terms summed as a balanced tree. ffmpeg's expression parser rejects a flat sum of
/// more than 100 terms (ffmpeg 9.0.2: "Cannot allocate memory"); nested by halves, 768 frames
/// (transformers' `max_frames`) are 10 levels deep.
fn select_expression(indices: &[usize]) -> String {
    fn sum(out: &mut String, indices: &[usize]) {
        if let [i] = indices {
            out.push_str(&format!("eq(n\\,{i})"));
            return;
        }
        let (a, b) = indices.split_at(indices.len() / 2);
        out.push('(');
        sum(out, a);
        out.push('+');
        sum(out, b);
        out.push(')');
    }
    let mut out = String::from("select='");
    sum(&mut out, indices);
    out.push('\'');
    out
}

/// Decodes the frames numbered `indices` (ascending, distinct, each `< info.frames`), streaming
/// ffmpeg's RGB output and keeping only them.
pub fn decode_frames(
    ffmpeg: &Ffmpeg,
    path: &Path,
    info: &VideoInfo,
    indices: &[usize],
) -> Result<Vec<RgbImage>, VisionError> {
    if indices.is_empty() {
        return Ok(Vec::new());
    }
    if let Some(w) = indices.windows(2).find(|w| w[0] >= w[1]) {
        return Err(VisionError::Argument {
            message: format!("frame indices must be ascending and distinct, got {w:?}"),
        });
    }
    let last = indices[indices.len() - 1];
    if last >= info.frames {
        return Err(file_error(
            path,
            format!(
                "frame {last} asked for, the video has {} frames",
                info.frames
            ),
        ));
    }
    if info.height == 0 || info.width == 0 {
        return Err(file_error(
            path,
            format!("a frame size of {}×{}", info.height, info.width),
        ));
    }
    // the probed size comes from the file: bound what decoding would allocate before ffmpeg
    // runs (each frame as an image, all of them together)
    let pixels = (info.height as u64).saturating_mul(info.width as u64);
    if pixels > super::processor::MAX_IMAGE_PIXELS {
        return Err(file_error(
            path,
            format!(
                "frames of {}×{} are more than {} pixels (the image limit); refused before decoding",
                info.height,
                info.width,
                super::processor::MAX_IMAGE_PIXELS
            ),
        ));
    }
    let total = pixels
        .saturating_mul(3)
        .saturating_mul(indices.len() as u64);
    if total > MAX_DECODED_VIDEO_BYTES {
        return Err(file_error(
            path,
            format!(
                "{} frames of {}×{} would decode to {} MiB, more than {} MiB; sample fewer \
                 frames (a lower video_fps) or scale the video down first",
                indices.len(),
                info.height,
                info.width,
                total >> 20,
                MAX_DECODED_VIDEO_BYTES >> 20
            ),
        ));
    }
    let mut last_stderr = Vec::new();
    for flag in FPS_MODE_FLAGS {
        match decode_run(ffmpeg, path, info, indices, flag)? {
            Ok(frames) => return Ok(frames),
            Err(stderr) => last_stderr = stderr,
        }
    }
    Err(no_fps_mode(ffmpeg, path, &last_stderr))
}

/// One decoding run with `flag passthrough`; `Ok(Err(stderr))` when this ffmpeg does not know
/// `flag`.
fn decode_run(
    ffmpeg: &Ffmpeg,
    path: &Path,
    info: &VideoInfo,
    indices: &[usize],
    flag: &str,
) -> Result<Result<Vec<RgbImage>, Vec<u8>>, VisionError> {
    let mut cmd = ffmpeg.command();
    cmd.args([
        "-nostdin",
        "-hide_banner",
        "-nostats",
        "-loglevel",
        "error",
        "-noautorotate",
        "-i",
    ])
    .arg(input_url(path))
    .args(["-map", "0:V:0"]);
    // Ascending, distinct and below `frames`: as many as `frames` means all of them.
    if indices.len() != info.frames {
        cmd.arg("-vf").arg(select_expression(indices));
    }
    cmd.args([flag, "passthrough", "-frames:v"])
        .arg(indices.len().to_string())
        .args(["-f", "rawvideo", "-pix_fmt", "rgb24", "-"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|e| ffmpeg.spawn_error(path, e))?;
    let mut stderr = child.stderr.take().expect("piped stderr");
    let mut stdout = child.stdout.take().expect("piped stdout");
    let child = Arc::new(Mutex::new(child));
    let dog = Watchdog::start(Arc::clone(&child), ffmpeg.timeout);
    // Read stderr alongside stdout so that a chatty ffmpeg never blocks on a full pipe.
    let stderr_reader = std::thread::spawn(move || {
        // the first MiB is kept for messages, the rest drained
        let mut buf = Vec::new();
        let _ = (&mut stderr).take(1 << 20).read_to_end(&mut buf);
        let _ = std::io::copy(&mut stderr, &mut std::io::sink());
        buf
    });
    let frame_bytes = info.height * info.width * 3;
    let mut buffers = Vec::with_capacity(indices.len());
    let mut short = false;
    for _ in indices {
        let mut buf = vec![0u8; frame_bytes];
        if stdout.read_exact(&mut buf).is_err() {
            short = true;
            break;
        }
        buffers.push(buf);
    }
    // Anything after the last frame means the frames were not the size probed.
    let mut extra = 0usize;
    if !short {
        let mut sink = vec![0u8; 1 << 16];
        loop {
            match stdout.read(&mut sink) {
                Ok(0) => break,
                Ok(n) => extra += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
    }
    drop(stdout);
    let status = reap(&child);
    let stderr = stderr_reader.join().unwrap_or_default();
    if dog.stop() {
        return Err(ffmpeg.timed_out(path, "decoding the sampled frames"));
    }
    let status = status.map_err(|e| VisionError::Io {
        file: path.to_path_buf(),
        source: e,
    })?;
    if !status.success() {
        if buffers.is_empty() && unrecognized(&stderr, flag) {
            return Ok(Err(stderr));
        }
        return Err(file_error(
            path,
            format!(
                "ffmpeg failed decoding the video ({status}; {}); ffmpeg said:\n{}",
                ffmpeg.describe(),
                stderr_tail(&stderr)
            ),
        ));
    }
    if short {
        return Err(file_error(
            path,
            format!(
                "ffmpeg's output ended after {} whole frame(s) of {}×{} where {} were expected; \
                 ffmpeg said:\n{}",
                buffers.len(),
                info.height,
                info.width,
                indices.len(),
                stderr_tail(&stderr)
            ),
        ));
    }
    if extra > 0 {
        return Err(file_error(
            path,
            format!(
                "ffmpeg gave {extra} byte(s) more than the {} frame(s) of {}×{} expected (does \
                 the frame size change within the video?)",
                indices.len(),
                info.height,
                info.width
            ),
        ));
    }
    let frames = buffers
        .into_iter()
        .map(|b| RgbImage::new(info.height, info.width, b))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Ok(frames))
}

/// Decodes a video file with ffmpeg from `$ARES_FFMPEG` or `PATH` and processes it: count
/// frames, sample them at `sampling.fps` (every frame without a rate), decode only the sampled
/// frames, resize, normalise, patchify. Errors name the file.
pub fn process_video_file(
    path: &Path,
    sampling: VideoSampling,
    cfg: &ProcessorConfig,
) -> Result<ProcessedVideo, VisionError> {
    process_video_file_with(&Ffmpeg::from_env(), path, sampling, cfg)
}

/// [`process_video_file`] with a given ffmpeg.
pub fn process_video_file_with(
    ffmpeg: &Ffmpeg,
    path: &Path,
    sampling: VideoSampling,
    cfg: &ProcessorConfig,
) -> Result<ProcessedVideo, VisionError> {
    let info = probe(ffmpeg, path)?;
    let indices = sample_indices(path, &info, sampling, cfg)?;
    let frames = decode_frames(ffmpeg, path, &info, &indices)?;
    let chosen: Vec<&RgbImage> = frames.iter().collect();
    process_chosen(&chosen, indices, cfg).map_err(|e| match e {
        e @ (VisionError::Io { .. } | VisionError::VideoFile { .. }) => e,
        other => VisionError::InFile {
            file: path.to_path_buf(),
            source: Box::new(other),
        },
    })
}

/// The indices [`process_video_file`] decodes: [`sample_frame_indices`] over the decoded frame
/// count, at the file's rate (`sampling.source_fps` only when the file has none).
pub fn sample_indices(
    path: &Path,
    info: &VideoInfo,
    sampling: VideoSampling,
    cfg: &ProcessorConfig,
) -> Result<Vec<usize>, VisionError> {
    let source_fps = info.fps.or(sampling.source_fps);
    if let (Some(fps), None) = (sampling.fps, source_fps) {
        return Err(file_error(
            path,
            format!(
                "the video stream has no frame rate, and sampling at {fps} fps needs one: pass the \
                 rate as source_fps"
            ),
        ));
    }
    sample_frame_indices(
        info.frames,
        VideoSampling {
            source_fps,
            fps: sampling.fps,
        },
        cfg,
    )
    .map_err(|e| VisionError::InFile {
        file: path.to_path_buf(),
        source: Box::new(e),
    })
}

// ---------------------------------------------------------------------------------------------
// Parsing ffmpeg's stream lines
// ---------------------------------------------------------------------------------------------

/// What the stream lines of `ffmpeg -i FILE … -f null -` say about the mapped video stream.
#[derive(Debug, Clone, PartialEq)]
struct StreamLines {
    /// The input stream's line (after `Video: `).
    input_line: String,
    codec: String,
    /// (height, width): the output stream's (the decoded frames'), else the input's.
    size: Option<(usize, usize)>,
    /// The input stream's average rate.
    fps: Option<f64>,
}

/// Splits at commas outside parentheses and brackets.
fn split_top_level(s: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0i32, 0usize);
    for (i, c) in s.char_indices() {
        match c {
            '(' | '[' => depth += 1,
            ')' | ']' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(s[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(s[start..].trim());
    parts
}

/// `WxH` at the start of a field (`64x48 [SAR 1:1 DAR 4:3]`), as (height, width).
fn parse_size(field: &str) -> Option<(usize, usize)> {
    let token = field.split_whitespace().next()?;
    let (w, h) = token.split_once('x')?;
    let all_digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !(all_digits(w) && all_digits(h)) {
        return None;
    }
    let (w, h) = (w.parse::<usize>().ok()?, h.parse::<usize>().ok()?);
    (w > 0 && h > 0).then_some((h, w))
}

/// A rate as ffmpeg's `print_fps` writes it (`10`, `29.97`, `0.0417`, `1k`), NTSC rates restored.
fn parse_rate(text: &str) -> Option<f64> {
    let (digits, scale) = match text.strip_suffix('k') {
        Some(d) => (d, 1000.0),
        None => (text, 1.0),
    };
    let v: f64 = digits.parse().ok()?;
    let v = v * scale;
    if !(v.is_finite() && v > 0.0) {
        return None;
    }
    // Printed to two decimals: 30000/1001 shows as 29.97. Restore N·1000/1001 when the printed
    // value is within that rounding of it (and is not a whole number, which ffmpeg prints for
    // rates within 0.005 of one).
    if scale == 1.0 && digits.contains('.') && digits.split('.').nth(1).map(str::len) == Some(2) {
        let n = (v * 1.001).round();
        let ntsc = n * 1000.0 / 1001.0;
        if n >= 1.0 && (ntsc - v).abs() <= 0.005 + 1e-9 {
            return Some(ntsc);
        }
    }
    Some(v)
}

/// The `(index)` of `Stream #0:(index)` starting a (trimmed) line, and the rest of the line.
fn stream_index(line: &str) -> Option<(usize, &str)> {
    let rest = line.trim_start().strip_prefix("Stream #0:")?;
    let end = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    Some((rest[..end].parse().ok()?, &rest[end..]))
}

fn video_fields(rest: &str) -> Option<&str> {
    rest.split_once(": Video: ").map(|(_, v)| v)
}

fn parse_stream_lines(stderr: &str) -> Option<StreamLines> {
    // The input stream ffmpeg mapped: `Stream #0:1 -> #0:0 (h264 (native) -> …)`.
    let mut section = "";
    let mut mapped: Option<usize> = None;
    let mut inputs: Vec<(usize, String)> = Vec::new();
    let mut output_size = None;
    for line in stderr.lines() {
        let t = line.trim_start();
        if t.starts_with("Input #") {
            section = if t.starts_with("Input #0,") {
                "input"
            } else {
                ""
            };
            continue;
        }
        if t.starts_with("Output #") {
            section = "output";
            continue;
        }
        if t.starts_with("Stream mapping:") {
            section = "mapping";
            continue;
        }
        match section {
            "input" => {
                if let Some((i, rest)) = stream_index(t)
                    && let Some(v) = video_fields(rest)
                {
                    inputs.push((i, v.to_string()));
                }
            }
            "mapping" => {
                if mapped.is_none()
                    && let Some((i, rest)) = stream_index(t)
                    && rest.trim_start().starts_with("->")
                {
                    mapped = Some(i);
                }
            }
            "output" => {
                if output_size.is_none()
                    && let Some((_, rest)) = stream_index(t)
                    && let Some(v) = video_fields(rest)
                {
                    output_size = split_top_level(v)
                        .iter()
                        .skip(1)
                        .find_map(|f| parse_size(f));
                }
            }
            _ => {}
        }
    }
    let line = match mapped {
        Some(i) => inputs.iter().find(|(j, _)| *j == i)?.1.clone(),
        None => inputs.first()?.1.clone(),
    };
    let fields = split_top_level(&line);
    let codec = fields[0]
        .split_whitespace()
        .next()
        .unwrap_or("")
        .to_string();
    let input_size = fields.iter().skip(1).find_map(|f| parse_size(f));
    let fps = fields.iter().find_map(|f| {
        let mut it = f.split_whitespace();
        let (v, unit) = (it.next()?, it.next()?);
        (unit == "fps").then(|| parse_rate(v)).flatten()
    });
    Some(StreamLines {
        input_line: line,
        codec,
        size: output_size.or(input_size),
        fps,
    })
}

/// Processes a video given as a directory of frame images (sorted by file name), or as a video
/// file (any file that is not a PNG / JPEG / WebP image: mp4, webm, mkv, mov, …), decoded with
/// ffmpeg ([`process_video_file`]; the file's own frame rate is the source rate,
/// `sampling.source_fps` is used only when the file has none).
pub fn process_video_path(
    path: &Path,
    sampling: VideoSampling,
    cfg: &ProcessorConfig,
) -> Result<ProcessedVideo, VisionError> {
    if path.is_dir() {
        let files = frame_files(path)?;
        return process_video_files(&files, sampling, cfg);
    }
    if path.is_file() && has_extension(path, &FRAME_EXTENSIONS) {
        return Err(VisionError::InFile {
            file: path.to_path_buf(),
            source: Box::new(VisionError::Video {
                message: "a single image is not a video: pass the frames as a list of files or a directory".into(),
            }),
        });
    }
    if path.is_file() {
        return process_video_file(path, sampling, cfg);
    }
    Err(VisionError::Io {
        file: path.to_path_buf(),
        source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or directory"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MP4: &str = "Input #0, mov,mp4,m4a,3gp,3g2,mj2, from 'file:a.mp4':
  Metadata:
    major_brand     : isom
  Duration: 00:00:01.33, start: 0.000000, bitrate: 41 kb/s
  Stream #0:0[0x1](und): Video: h264 (High 4:4:4 Predictive) (avc1 / 0x31637661), gbrp(pc, gbr/unknown/unknown, progressive), 64x48 [SAR 1:1 DAR 4:3], 35 kb/s, 29.97 fps, 29.97 tbr, 30k tbn (default)
    Metadata:
      handler_name    : VideoHandler
Stream mapping:
  Stream #0:0 -> #0:0 (h264 (native) -> wrapped_avframe (native))
Output #0, null, to 'pipe:':
  Stream #0:0(und): Video: wrapped_avframe, gbrp(pc, gbr/unknown/unknown, progressive), 64x48 [SAR 1:1 DAR 4:3], q=2-31, 200 kb/s, 29.97 fps, 30k tbn (default)
";

    #[test]
    fn parses_an_mp4_stream_line() {
        let s = parse_stream_lines(MP4).unwrap();
        assert_eq!(s.codec, "h264");
        assert_eq!(s.size, Some((48, 64)));
        assert_eq!(s.fps, Some(30000.0 / 1001.0));
    }

    #[test]
    fn picks_the_mapped_stream() {
        let text = "Input #0, matroska,webm, from 'x.mkv':
  Stream #0:0: Audio: opus, 48000 Hz, stereo, fltp
  Stream #0:1: Video: mjpeg (Baseline), yuvj420p(pc, bt470bg/unknown/unknown), 10x10, 90k tbr, 90k tbn (attached pic)
  Stream #0:2(eng): Video: vp9 (Profile 0), yuv420p(tv, bt709), 1920x1080, SAR 1:1 DAR 16:9, 25 fps, 25 tbr, 1k tbn
Stream mapping:
  Stream #0:2 -> #0:0 (vp9 (native) -> wrapped_avframe (native))
";
        let s = parse_stream_lines(text).unwrap();
        assert_eq!(s.codec, "vp9");
        assert_eq!(s.size, Some((1080, 1920)));
        assert_eq!(s.fps, Some(25.0));
    }

    #[test]
    fn rates_as_ffmpeg_prints_them() {
        assert_eq!(parse_rate("10"), Some(10.0));
        assert_eq!(parse_rate("12.50"), Some(12.5));
        assert_eq!(parse_rate("23.98"), Some(24000.0 / 1001.0));
        assert_eq!(parse_rate("59.94"), Some(60000.0 / 1001.0));
        assert_eq!(parse_rate("14.99"), Some(15000.0 / 1001.0));
        assert_eq!(parse_rate("29.83"), Some(29.83));
        assert_eq!(parse_rate("0.0417"), Some(0.0417));
        assert_eq!(parse_rate("1k"), Some(1000.0));
        assert_eq!(parse_rate("0"), None);
        assert_eq!(parse_rate("nan"), None);
        assert_eq!(parse_rate("x"), None);
    }

    #[test]
    fn sizes_and_fields() {
        assert_eq!(parse_size("64x48 [SAR 1:1 DAR 4:3]"), Some((48, 64)));
        assert_eq!(parse_size("0x31637661)"), None);
        assert_eq!(parse_size("0x0"), None);
        assert_eq!(parse_size("q=2-31"), None);
        assert_eq!(
            split_top_level("h264 (a, b), gbrp(pc, gbr), 64x48 [SAR 1:1, x], 10 fps"),
            vec![
                "h264 (a, b)",
                "gbrp(pc, gbr)",
                "64x48 [SAR 1:1, x]",
                "10 fps"
            ]
        );
        assert_eq!(select_expression(&[7]), "select='eq(n\\,7)'");
        assert_eq!(
            select_expression(&[0, 5, 12]),
            "select='(eq(n\\,0)+(eq(n\\,5)+eq(n\\,12)))'"
        );
        // Nesting grows as log2 of the count.
        let e = select_expression(&(0..768).collect::<Vec<_>>());
        let (mut depth, mut max) = (0i32, 0i32);
        for c in e.chars() {
            depth += i32::from(c == '(') - i32::from(c == ')');
            max = max.max(depth);
        }
        assert_eq!(depth, 0);
        assert!(max <= 11, "{max}");
    }

    #[test]
    fn no_video_stream_line() {
        assert!(
            parse_stream_lines("Input #0, wav, from 'a.wav':\n  Stream #0:0: Audio: pcm_s16le\n")
                .is_none()
        );
    }

    #[test]
    fn locate_prefers_the_environment() {
        let f = Ffmpeg::locate(Some("/opt/ff/ffmpeg".into()));
        assert_eq!(f.program(), Path::new("/opt/ff/ffmpeg"));
        assert_eq!(f.describe(), "ARES_FFMPEG=/opt/ff/ffmpeg");
        assert_eq!(
            Ffmpeg::locate(Some("".into())).program(),
            Path::new("ffmpeg")
        );
        assert_eq!(Ffmpeg::locate(None).describe(), "`ffmpeg` on PATH");
    }
}
