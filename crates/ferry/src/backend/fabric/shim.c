/* The libfabric calls of Ferry's fabric backend (crates/ferry/src/backend/fabric).
 *
 * Most of libfabric's API is static inline functions that dispatch through
 * the ops tables of each object, so Rust cannot link against them. This
 * file wraps the few calls the backend makes behind a flat interface of
 * opaque handles and plain integers: the Rust side never sees a libfabric
 * struct, so no struct layout is duplicated (and none can drift from the
 * installed headers). Every function returns 0 or a negative libfabric
 * error code unless it says otherwise.
 *
 * libfabric itself is not linked: ferry_fi_load opens it (dlopen) when the
 * first fabric endpoint is opened, so a program built with the backend but
 * not using it never loads libfabric and its providers (some of which
 * change the process at load time, see ferry_fi_load). */
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>

/* The functions libfabric exports that the shim calls, directly or through
 * the headers' inline functions (fi_allocinfo calls fi_dupinfo); the other
 * calls go through ops tables. Each name becomes a call through a pointer
 * that ferry_fi_load fills in: with these macros, the headers' own
 * prototypes declare the pointers, with the types the headers give. */
#define fi_getinfo (*ferry_dl_fi_getinfo)
#define fi_freeinfo (*ferry_dl_fi_freeinfo)
#define fi_dupinfo (*ferry_dl_fi_dupinfo)
#define fi_fabric (*ferry_dl_fi_fabric)
#define fi_strerror (*ferry_dl_fi_strerror)

#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_errno.h>

/* libfabric's file name: its soname, unless FERRY_LIBFABRIC names another
 * (a vendor's build, say /opt/amazon/efa/lib/libfabric.so.1). */
#define FERRY_LIBFABRIC_SONAME "libfabric.so.1"

static pthread_mutex_t load_lock = PTHREAD_MUTEX_INITIALIZER;
static void *libfabric;

/* Load libfabric once: 0, or -FI_ENOSYS with `err` saying why (a library
 * that is not there, or one without a function the shim needs).
 *
 * Loading runs the constructors of libfabric's providers' libraries, and
 * Debian's psm provider (libinfinipath) installs handlers for SIGSEGV,
 * SIGBUS, SIGILL, SIGABRT, SIGINT and SIGTERM there, which write a
 * backtrace file and exit. They are debugging aids of that provider, not
 * something the library needs, and they would take a process's own
 * dispositions from it (a protection fault would no longer kill it by its
 * signal), so every disposition the load changed is put back as it was. */
int ferry_fi_load(char *err, size_t errlen)
{
	int rc = 0;
	pthread_mutex_lock(&load_lock);
	if (libfabric)
		goto out;
	struct sigaction before[NSIG];
	for (int sig = 1; sig < NSIG; sig++)
		if (sigaction(sig, NULL, &before[sig]))
			before[sig].sa_handler = SIG_ERR;
	const char *file = getenv("FERRY_LIBFABRIC");
	if (!file || !*file)
		file = FERRY_LIBFABRIC_SONAME;
	void *lib = dlopen(file, RTLD_NOW | RTLD_LOCAL);
	for (int sig = 1; sig < NSIG; sig++) {
		struct sigaction now;
		if (before[sig].sa_handler == SIG_ERR || sigaction(sig, NULL, &now))
			continue;
		if (now.sa_handler != before[sig].sa_handler || now.sa_flags != before[sig].sa_flags)
			sigaction(sig, &before[sig], NULL);
	}
	if (!lib) {
		const char *why = dlerror();
		snprintf(err, errlen, "%s", why ? why : file);
		rc = -FI_ENOSYS;
		goto out;
	}
	struct {
		const char *name;
		void **slot;
	} symbols[] = {
		{ "fi_getinfo", (void **)&ferry_dl_fi_getinfo },
		{ "fi_freeinfo", (void **)&ferry_dl_fi_freeinfo },
		{ "fi_dupinfo", (void **)&ferry_dl_fi_dupinfo },
		{ "fi_fabric", (void **)&ferry_dl_fi_fabric },
		{ "fi_strerror", (void **)&ferry_dl_fi_strerror },
	};
	for (size_t i = 0; i < sizeof(symbols) / sizeof(symbols[0]); i++) {
		*symbols[i].slot = dlsym(lib, symbols[i].name);
		if (!*symbols[i].slot) {
			snprintf(err, errlen, "%s has no %s", file, symbols[i].name);
			for (size_t j = 0; j < i; j++)
				*symbols[j].slot = NULL;
			dlclose(lib);
			rc = -FI_ENOSYS;
			goto out;
		}
	}
	libfabric = lib;
out:
	pthread_mutex_unlock(&load_lock);
	return rc;
}

#define FERRY_FI_VERSION FI_VERSION(1, 9)

/* What the backend asks of a provider's endpoint. */
#define FERRY_CAPS (FI_MSG | FI_RMA | FI_SEND | FI_RECV | FI_WRITE | FI_REMOTE_WRITE)
/* The memory-registration modes the backend handles. */
#define FERRY_MR_MODE (FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT)

struct ferry_fi {
	struct fi_info *info;
	struct fid_fabric *fabric;
	struct fid_domain *domain;
	struct fid_ep *ep;
	struct fid_cq *cq;
	struct fid_av *av;
	fi_addr_t peer;
	int wait_fd;
};

void ferry_fi_close(struct ferry_fi *h)
{
	if (!h)
		return;
	/* The endpoint first: it refers to the queue and the address vector. */
	if (h->ep)
		fi_close(&h->ep->fid);
	if (h->av)
		fi_close(&h->av->fid);
	if (h->cq)
		fi_close(&h->cq->fid);
	if (h->domain)
		fi_close(&h->domain->fid);
	if (h->fabric)
		fi_close(&h->fabric->fid);
	if (h->info)
		fi_freeinfo(h->info);
	free(h);
}

static int fail(struct ferry_fi *h, int rc, const char *what, char *err, size_t errlen)
{
	snprintf(err, errlen, "%s: %s", what, fi_strerror(rc < 0 ? -rc : rc));
	ferry_fi_close(h);
	return rc < 0 ? rc : -rc;
}

/* Open an RDM endpoint with RMA and messages on `provider` (NULL: the
 * first that fits; FI_PROVIDER narrows it too), its source address `node`
 * (NULL: any), a completion queue of `cq_size` entries whose wait object
 * is a file descriptor, and an address vector for one peer. On failure `err`
 * says which step failed and why. */
int ferry_fi_open(const char *provider, const char *node, size_t cq_size, struct ferry_fi **out, char *err,
		  size_t errlen)
{
	struct ferry_fi *h = calloc(1, sizeof(*h));
	struct fi_info *hints = fi_allocinfo();
	int rc;
	if (!h || !hints) {
		free(h);
		fi_freeinfo(hints);
		snprintf(err, errlen, "out of memory");
		return -FI_ENOMEM;
	}
	h->wait_fd = -1;
	hints->caps = FERRY_CAPS;
	hints->ep_attr->type = FI_EP_RDM;
	hints->mode = FI_CONTEXT | FI_CONTEXT2 | FI_RX_CQ_DATA;
	hints->domain_attr->mr_mode = FERRY_MR_MODE;
	hints->domain_attr->threading = FI_THREAD_DOMAIN;
	/* Messages arrive in the order they were sent. */
	hints->tx_attr->msg_order = FI_ORDER_SAS;
	hints->rx_attr->msg_order = FI_ORDER_SAS;
	if (provider) {
		hints->fabric_attr->prov_name = strdup(provider);
		if (!hints->fabric_attr->prov_name) {
			fi_freeinfo(hints);
			free(h);
			snprintf(err, errlen, "out of memory");
			return -FI_ENOMEM;
		}
	}
	rc = fi_getinfo(FERRY_FI_VERSION, node, NULL, node ? FI_SOURCE : 0, hints, &h->info);
	fi_freeinfo(hints);
	if (rc)
		return fail(h, rc, "no provider offers a reliable endpoint with RMA writes, remote completion data and ordered messages (fi_getinfo)", err, errlen);
	if (h->info->domain_attr->cq_data_size < 4)
		return fail(h, -FI_ENODATA, "the provider carries fewer than 4 bytes of remote completion data", err, errlen);
	if ((rc = fi_fabric(h->info->fabric_attr, &h->fabric, NULL)))
		return fail(h, rc, "fi_fabric", err, errlen);
	if ((rc = fi_domain(h->fabric, h->info, &h->domain, NULL)))
		return fail(h, rc, "fi_domain", err, errlen);
	struct fi_cq_attr cq_attr = { 0 };
	cq_attr.size = cq_size;
	cq_attr.format = FI_CQ_FORMAT_DATA;
	cq_attr.wait_obj = FI_WAIT_FD;
	if ((rc = fi_cq_open(h->domain, &cq_attr, &h->cq, NULL)))
		return fail(h, rc, "fi_cq_open (a completion queue with a file descriptor to wait on)", err, errlen);
	struct fi_av_attr av_attr = { 0 };
	av_attr.type = FI_AV_TABLE;
	av_attr.count = 1;
	if ((rc = fi_av_open(h->domain, &av_attr, &h->av, NULL)))
		return fail(h, rc, "fi_av_open", err, errlen);
	if ((rc = fi_endpoint(h->domain, h->info, &h->ep, NULL)))
		return fail(h, rc, "fi_endpoint", err, errlen);
	if ((rc = fi_ep_bind(h->ep, &h->cq->fid, FI_TRANSMIT | FI_RECV)))
		return fail(h, rc, "fi_ep_bind (completion queue)", err, errlen);
	if ((rc = fi_ep_bind(h->ep, &h->av->fid, 0)))
		return fail(h, rc, "fi_ep_bind (address vector)", err, errlen);
	if ((rc = fi_enable(h->ep)))
		return fail(h, rc, "fi_enable", err, errlen);
	if ((rc = fi_control(&h->cq->fid, FI_GETWAIT, &h->wait_fd)))
		return fail(h, rc, "fi_control(FI_GETWAIT) (the completion queue's file descriptor)", err, errlen);
	*out = h;
	return 0;
}

/* Close the endpoint alone: nothing is received or sent any more (the
 * registrations and the domain stay until ferry_fi_close). */
void ferry_fi_close_ep(struct ferry_fi *h)
{
	if (h->ep) {
		fi_close(&h->ep->fid);
		h->ep = NULL;
	}
}

const char *ferry_fi_provider(const struct ferry_fi *h)
{
	return h->info->fabric_attr->prov_name;
}

int ferry_fi_wait_fd(const struct ferry_fi *h)
{
	return h->wait_fd;
}

/* Whether remote addresses are virtual addresses (else offsets into the
 * registered region). */
int ferry_fi_virt_addr(const struct ferry_fi *h)
{
	return (h->info->domain_attr->mr_mode & FI_MR_VIRT_ADDR) != 0;
}

/* This endpoint's fabric address into buf; *len: its room in, the
 * address's length out. */
int ferry_fi_getname(struct ferry_fi *h, void *buf, size_t *len)
{
	return fi_getname(&h->ep->fid, buf, len);
}

/* The peer's fabric address: the one destination of this endpoint. */
int ferry_fi_set_peer(struct ferry_fi *h, const void *addr)
{
	int n = fi_av_insert(h->av, addr, 1, &h->peer, 0, NULL);
	return n == 1 ? 0 : (n < 0 ? n : -FI_EADDRNOTAVAIL);
}

/* Register [buf, buf + len) for sends from it and receives into it, and
 * if `remote_write`, for RMA writes from it and the peer's RMA writes into
 * it (memory the peer must not write, such as the message ring, is
 * registered without). */
int ferry_fi_mr_reg(struct ferry_fi *h, void *buf, size_t len, int remote_write, uint64_t requested_key,
		    struct fid_mr **mr, uint64_t *key, void **desc)
{
	uint64_t access = FI_SEND | FI_RECV;
	if (remote_write)
		access |= FI_WRITE | FI_REMOTE_WRITE;
	int rc = fi_mr_reg(h->domain, buf, len, access, 0, requested_key, 0, mr, NULL);
	if (rc)
		return rc;
	if (h->info->domain_attr->mr_mode & FI_MR_ENDPOINT) {
		if ((rc = fi_mr_bind(*mr, &h->ep->fid, 0)) || (rc = fi_mr_enable(*mr))) {
			fi_close(&(*mr)->fid);
			return rc;
		}
	}
	*key = fi_mr_key(*mr);
	*desc = fi_mr_desc(*mr);
	return 0;
}

int ferry_fi_mr_close(struct fid_mr *mr)
{
	return fi_close(&mr->fid);
}

/* Post a receive into buf; ctx is the operation's context (room for a
 * struct fi_context2). Returns 0, -FI_EAGAIN or an error. */
long ferry_fi_recv(struct ferry_fi *h, void *buf, size_t len, void *desc, void *ctx)
{
	return fi_recv(h->ep, buf, len, desc, FI_ADDR_UNSPEC, ctx);
}

/* Send buf to the peer. */
long ferry_fi_send(struct ferry_fi *h, const void *buf, size_t len, void *desc, void *ctx)
{
	return fi_send(h->ep, buf, len, desc, h->peer, ctx);
}

/* Write buf into the peer's memory at raddr (key), with `data` as the
 * completion data the peer's queue reports once the bytes are there. */
long ferry_fi_writedata(struct ferry_fi *h, const void *buf, size_t len, void *desc, uint64_t data, uint64_t raddr,
			uint64_t key, void *ctx)
{
	return fi_writedata(h->ep, buf, len, desc, data, h->peer, raddr, key, ctx);
}

/* One completion, flattened. */
struct ferry_cqe {
	void *ctx;
	uint64_t flags;
	uint64_t len;
	uint64_t data;
	/* 0, or the (positive) libfabric error of a failed operation. */
	int32_t err;
	int32_t prov_errno;
};

static void flatten(struct ferry_cqe *out, void *ctx, uint64_t flags, uint64_t len, uint64_t data, int32_t err,
		    int32_t prov_errno)
{
	out->ctx = ctx;
	out->flags = flags;
	out->len = len;
	out->data = data;
	out->err = err;
	out->prov_errno = prov_errno;
}

/* Up to n completions into out (a failed one alone, with err set): how
 * many, 0 if none, or a negative error of the queue itself. Progresses the
 * provider (manual progress). */
long ferry_fi_cq_read(struct ferry_fi *h, struct ferry_cqe *out, size_t n)
{
	struct fi_cq_data_entry e[16];
	if (n > 16)
		n = 16;
	ssize_t got = fi_cq_read(h->cq, e, n);
	if (got == -FI_EAGAIN)
		return 0;
	if (got == -FI_EAVAIL) {
		struct fi_cq_err_entry ee;
		memset(&ee, 0, sizeof(ee));
		ssize_t r = fi_cq_readerr(h->cq, &ee, 0);
		if (r == -FI_EAGAIN)
			return 0;
		if (r < 0)
			return r;
		flatten(out, ee.op_context, ee.flags, ee.len, ee.data, ee.err ? ee.err : FI_EOTHER, ee.prov_errno);
		return 1;
	}
	if (got < 0)
		return got;
	for (ssize_t i = 0; i < got; i++)
		flatten(&out[i], e[i].op_context, e[i].flags, e[i].len, e[i].data, 0, 0);
	return got;
}

/* 0 if the queue's file descriptor may be slept on now; -FI_EAGAIN if
 * the queue must be read first. */
int ferry_fi_trywait(struct ferry_fi *h)
{
	struct fid *fids[1] = { &h->cq->fid };
	return fi_trywait(h->fabric, fids, 1);
}

const char *ferry_fi_strerror(int err)
{
	if (!ferry_dl_fi_strerror)
		return "libfabric is not loaded";
	return fi_strerror(err < 0 ? -err : err);
}

/* Whether a completion with these flags is the peer's write into our
 * memory: it carries remote completion data (the backend sends no message
 * with data). */
int ferry_fi_is_remote_write(uint64_t flags)
{
	return (flags & (FI_REMOTE_WRITE | FI_REMOTE_CQ_DATA)) != 0;
}
