//! The media stage's families for `/metrics`: where its inventory came from, its GPUs, jobs
//! by state and outcome, stage times, renditions, uploads, and each engine's units.

use std::fmt::Write;
use std::sync::atomic::Ordering;

use spindle_node_base::exposition::{label, Collect};
use spindle_node_base::metrics::{counters, histograms};

use super::MediaPool;

impl Collect for MediaPool {
    fn collect(&self, w: &mut String) {
        let (source, why) = match &self.inventory.source {
            spindle_gpu::Source::Nvml { driver } => ("nvml", driver.clone()),
            spindle_gpu::Source::Declared { why } => ("declared", why.clone()),
        };
        let _ = writeln!(w, "# HELP spindle_media_inventory Where the media inventory came from (declared: NVML unavailable, the detail says why).\n# TYPE spindle_media_inventory gauge");
        let detail = label(&why);
        let _ = writeln!(
            w,
            "spindle_media_inventory{{source=\"{source}\",detail=\"{detail}\",gpus=\"{}\"}} 1",
            self.inventory.devices.len()
        );
        if let Ok(latest) = self.latest.lock() {
            let _ = writeln!(
                w,
                "# HELP spindle_media_gpus GPUs the media stage found at start, and at its latest look.\n# TYPE spindle_media_gpus gauge\nspindle_media_gpus{{when=\"start\"}} {}\nspindle_media_gpus{{when=\"latest\"}} {}",
                self.inventory.devices.len(),
                latest.devices.len()
            );
            let _ = writeln!(w, "# HELP spindle_gpu_utilization_pct Each GPU's utilization at the latest look (NVML).\n# TYPE spindle_gpu_utilization_pct gauge");
            for d in &latest.devices {
                if let Some(u) = d.utilization_pct {
                    let _ = writeln!(w, "spindle_gpu_utilization_pct{{gpu=\"{}\"}} {u}", d.index);
                }
            }
        }
        let stats = &self.stats;
        let _ = writeln!(
            w,
            "# HELP spindle_media_jobs Media jobs waiting for a worker, and running.\n# TYPE spindle_media_jobs gauge\nspindle_media_jobs{{state=\"queued\"}} {}\nspindle_media_jobs{{state=\"running\"}} {}",
            stats.queued.load(Ordering::Relaxed),
            stats.running.load(Ordering::Relaxed)
        );
        counters(
            w,
            "spindle_media_jobs_ended_total",
            "Media jobs ended, by outcome.",
            "outcome",
            super::MEDIA_OUTCOMES.iter().zip(&stats.ended),
        );
        histograms(
            w,
            "spindle_media_stage_seconds",
            "A media job's stages: wait (submitted to placed on units), fetch, transcode (probe and ladder), upload.",
            "stage",
            super::MEDIA_STAGES.iter().zip(&stats.stages),
        );
        let _ = writeln!(
            w,
            "# HELP spindle_media_uploaded_bytes_total Bytes of renditions put into the bucket.\n# TYPE spindle_media_uploaded_bytes_total counter\nspindle_media_uploaded_bytes_total {}",
            stats.uploaded_bytes.load(Ordering::Relaxed)
        );
        let _ = writeln!(w, "# HELP spindle_media_renditions_total Renditions made, by where they were decoded and encoded (gpu: NVDEC, NVENC).\n# TYPE spindle_media_renditions_total counter");
        for (decode, row) in ["cpu", "gpu"].iter().zip(&stats.renditions) {
            for (encode, n) in ["cpu", "gpu"].iter().zip(row) {
                let _ = writeln!(
                    w,
                    "spindle_media_renditions_total{{decode=\"{decode}\",encode=\"{encode}\"}} {}",
                    n.load(Ordering::Relaxed)
                );
            }
        }
        let _ = writeln!(
            w,
            "# HELP spindle_media_gpu_fallbacks_total Media jobs placed on a GPU whose engine could not be used, then run on the CPU.\n# TYPE spindle_media_gpu_fallbacks_total counter\nspindle_media_gpu_fallbacks_total {}",
            stats.gpu_fallbacks.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            w,
            "# HELP spindle_media_uploads_aborted_total Multipart uploads left open by a node that died mid-upload, aborted by a sweep.\n# TYPE spindle_media_uploads_aborted_total counter\nspindle_media_uploads_aborted_total {}",
            stats.uploads_aborted.load(Ordering::Relaxed)
        );
        counters(
            w,
            "spindle_media_objects_deleted_total",
            "Renditions the node deleted from the bucket: a task's earlier attempt's (superseded), or a job's whose result was not taken (unclaimed).",
            "why",
            super::OBJECTS_DELETED.iter().zip(&stats.objects_deleted),
        );
        let _ = writeln!(w, "# HELP spindle_media_engine_units Media units per engine: capacity and used.\n# TYPE spindle_media_engine_units gauge");
        for (engine, capacity, used) in self.ledger.snapshot() {
            let _ = writeln!(
                w,
                "spindle_media_engine_units{{engine=\"{engine}\",kind=\"capacity\"}} {capacity}"
            );
            let _ = writeln!(
                w,
                "spindle_media_engine_units{{engine=\"{engine}\",kind=\"used\"}} {used}"
            );
        }
    }
}
