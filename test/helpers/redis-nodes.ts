/** The nodes of a `REDIS_CLUSTER_NODES`-style list (`host:port,host:port,…`), as ioredis's Cluster takes them. */
export function clusterNodes (list: string): Array<{ host: string, port: number }> {
  return list.split(',').map((address) => {
    const [host = '127.0.0.1', port = '0'] = address.split(':')
    return { host, port: Number(port) }
  })
}
