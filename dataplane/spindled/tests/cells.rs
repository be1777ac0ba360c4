//! Two cells — each a node on its own database — that name each other's tenants (`cells`): a
//! client of either cell's tenant reaching either node is sent to its own cell (`WrongNode`,
//! redirecting to the cell's address) and served there; each cell's database holds only its
//! own tenants' tasks. docs/scaling.md, "Past one database: cells".

mod common;

use common::{start_with, task, NodeConfig};
use spindle_client::{Client, ClientError, ClusterClient};
use spindle_control::testing::TestDb;
use spindle_core::TenantId;
use spindle_wire::ErrorCode;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A node of cell `name` serving `tenant` on `port`, naming the other cell's tenant and address.
fn cell(name: &str, port: u16, tenant: u32, other: (&str, u16, u32)) -> String {
    let (other_name, other_port, other_tenant) = other;
    NodeConfig::new()
        .node_id(name)
        .tenants([tenant])
        .section(&format!(
            "[[cells]]\nname = \"{other_name}\"\naddress = \"127.0.0.1:{other_port}\"\n\
             tenants = [{other_tenant}]"
        ))
        .toml()
        .replacen(
            "\nlisten = \"127.0.0.1:0\"",
            &format!("\nlisten = \"127.0.0.1:{port}\""),
            1,
        )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_cells_tenants_are_sent_to_their_cell_and_served_there() {
    let (db_a, db_b) = (TestDb::new().await, TestDb::new().await);
    let (port_a, port_b) = (free_port(), free_port());
    let a = start_with(&db_a, &cell("cell-a", port_a, 1, ("cell-b", port_b, 2))).await;
    let b = start_with(&db_b, &cell("cell-b", port_b, 2, ("cell-a", port_a, 1))).await;
    assert_eq!((a.addr.port(), b.addr.port()), (port_a, port_b));

    // A plain client of cell B's tenant at cell A's node is told where its cell is.
    let refused = Client::connect(a.addr, TenantId(2), "tenant-2-credential")
        .await
        .err()
        .expect("sent away");
    let ClientError::Refused(e) = &refused else {
        panic!("{refused:?}")
    };
    assert_eq!(e.code, ErrorCode::WrongNode, "{e:?}");
    assert_eq!(e.redirect.as_deref(), Some(b.addr.to_string().as_str()));
    // Before any credential is looked at: a wrong one gets the same answer.
    let wrong = Client::connect(a.addr, TenantId(2), "not-the-credential")
        .await
        .err()
        .expect("sent away");
    assert!(matches!(&wrong, ClientError::Refused(e) if e.code == ErrorCode::WrongNode));

    // Cluster clients of both cells' tenants, all seeded with cell A's node only, are served
    // each by its own cell; and with cell B's node only, the same.
    for seed in [a.addr, b.addr] {
        for tenant in [1u32, 2] {
            let client = ClusterClient::connect(
                &[seed.to_string()],
                TenantId(tenant),
                &format!("tenant-{tenant}-credential"),
            )
            .await
            .unwrap_or_else(|e| panic!("tenant {tenant} through {seed}: {e:?}"));
            let answer = client
                .submit(task(&format!("t{tenant}-via-{}", seed.port())))
                .await
                .unwrap();
            assert!(answer.decision.is_accepted(), "{answer:?}");
        }
    }
    // Each cell's database holds its own tenant's tasks, and only those.
    for (db, mine) in [(&db_a, 1i64), (&db_b, 2)] {
        let sql = db.sql().await.unwrap();
        let rows = sql
            .query(
                "SELECT tenant_id::bigint, count(*) FROM task GROUP BY 1 ORDER BY 1",
                &[],
            )
            .await
            .unwrap();
        let counts: Vec<(i64, i64)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
        assert_eq!(counts, vec![(mine, 2)], "cell of tenant {mine}");
    }
}
