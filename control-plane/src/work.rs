//! A node's reports and claims in one call (`spindle_work`): the reports first,
//! then the claims, in one transaction — so a claim sees the slots the reports before it
//! released, and a slot freed by a short job is taken again at the cost of one call, not of a
//! report call and then a claim call.

use crate::claim::{claim_result, ClaimArrays, ClaimRequest, ClaimResult};
use crate::db::{Call, Db};
use crate::error::{check_answered, StoreError};
use crate::report::{report_result, Report, ReportColumns, ReportResult};

impl Db {
    /// Applies `reports`, then claims `claims` for `node` (attempts leased for `lease_ms`), in
    /// one transaction: their results, each in its batch's order. A batch either kind of which
    /// is empty is the other's own call. A failure fails both (nothing of either committed,
    /// or — the answer lost — both in doubt, decided as each is alone).
    pub async fn work_batch(
        &self,
        node: &str,
        lease_ms: u32,
        reports: &[Report],
        claims: &[ClaimRequest],
    ) -> Result<(Vec<ReportResult>, Vec<ClaimResult>), StoreError> {
        if claims.is_empty() {
            return Ok((self.report_batch(reports).await?, Vec::new()));
        }
        if reports.is_empty() {
            return Ok((Vec::new(), self.claim_batch(node, lease_ms, claims).await?));
        }
        crate::report::validate(reports)?;
        crate::claim::validate(node, claims)?;
        self.store_results(reports).await?;
        let r = ReportColumns::new(reports);
        let task: Vec<i64> = claims.iter().map(|c| c.task.0 as i64).collect();
        let version: Vec<i32> = claims.iter().map(|c| c.expected_version as i32).collect();
        let a = ClaimArrays::new(claims.iter().map(Some));
        let lease_ms = i64::from(lease_ms);
        let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = r.params().to_vec();
        params.extend([
            &node as &(dyn tokio_postgres::types::ToSql + Sync),
            &lease_ms,
            &task,
            &version,
        ]);
        params.extend(a.params());
        let rows = self
            .answered(Call::Writes, self.client().query(&self.stmts.work, &params))
            .await?;
        check_answered("work", &rows, reports.len() + claims.len())?;
        let (report_rows, claim_rows) = rows.split_at(reports.len());
        if report_rows.iter().any(|r| r.get::<_, i16>(0) != 0)
            || claim_rows.iter().any(|r| r.get::<_, i16>(0) != 1)
        {
            return Err(StoreError::Corrupt(
                "work answered its rows out of order".into(),
            ));
        }
        let reported = report_rows
            .iter()
            .map(|r| report_result(r.get(2), r.get(3), r.get(4), r.get(5), r.get(9)))
            .collect::<Result<Vec<_>, _>>()?;
        let claimed = claim_rows
            .iter()
            .zip(claims)
            .map(|(r, c)| claim_result(c, r.get(2), r.get(6), r.get(7), r.get(8), r.get(9)))
            .collect::<Result<Vec<_>, _>>()?;
        Ok((reported, claimed))
    }
}
